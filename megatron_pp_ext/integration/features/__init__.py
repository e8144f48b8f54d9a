"""The megatron features the plugin adapts, one module each (what a feature declares: :mod:`.base`).

Importing this package registers them; :data:`ORDER` is the order in which their flag checks report and
their megatron patches are made (:func:`~..install.install`, :func:`~..arguments.validate_arguments`).
Adding a feature = one module here that registers a :class:`~.base.Feature`, imported below, its name in
:data:`ORDER` (docs/contributing.md).
"""

from __future__ import annotations

from typing import Any

from . import (
    backward_split,  # noqa: F401
    bitpipe_replicas,  # noqa: F401
    checkpoint_safety,  # noqa: F401
    chunk_fsdp,  # noqa: F401
    config_agreement,  # noqa: F401
    layer_placement,  # noqa: F401
    moe_layers,  # noqa: F401
    post_validation_step,  # noqa: F401
    tracing,  # noqa: F401
)
from .base import Feature, Wiring, registered

__all__ = ["ORDER", "Feature", "Wiring", "features", "prepare_training"]

# The features by name, in the order they check and activate: the agreement patch first; the tracer before
# the features that wrap the forward-backward (replicas' loss gather, post-validation's outermost replay);
# the layer layout before the replicas and FSDP patch megatron's model building; the B/W split last (an
# unsupported Transformer Engine refuses there, and install() undoes the rest).
ORDER = (
    "agreement",
    "tracing",
    "moe",
    "layer-layout",
    "replicas",
    "fsdp",
    "post-validation",
    "backward-split",
    "checkpoints",
)


def features() -> list[Feature]:
    """The registered features, in :data:`ORDER` (a feature missing from it: after those, as registered)."""
    known = registered()
    rank = {name: i for i, name in enumerate(ORDER)}
    return sorted(known, key=lambda f: (rank.get(f.name, len(ORDER)), known.index(f)))


def prepare_training(args: Any) -> None:
    """Every feature's set-up of the training script, for every run (after the flag checks)."""
    for feature in features():
        feature.prepare_training(args)
