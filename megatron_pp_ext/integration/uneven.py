"""Megatron's uneven-split flags under the plugin's V and bidirectional placements.

``--decoder-first-pipeline-num-layers``, ``--decoder-last-pipeline-num-layers``,
``--account-for-embedding-in-pipeline-split``, ``--account-for-loss-in-pipeline-split`` and
``--pipeline-model-parallel-layout`` describe megatron's loop placement: "first stage" is pipeline rank 0
(all its virtual chunks), a layout's stage ``i`` is rank ``i % p``, chunk ``i // p``. Under a V or
bidirectional placement the plugin reads them per *model stage* instead (the placement's stages in model
order; :func:`~megatron_pp_ext.schedules.layer_split.stage_layer_counts`) and :mod:`.layout` makes megatron
build exactly those layers. Megatron's own checks of the flags assume its placement and would refuse
splits that are fine here (a first stage of one layer with two chunks per rank) or accept ones that are
not, so for these placements megatron never sees them where it checks them:

* :func:`transformer_config_without_split` (active with :mod:`.layout`'s hooks): megatron's
  ``core_transformer_config_from_args`` builds the ``TransformerConfig`` without the flags (its
  ``__post_init__`` would raise), then the first / last counts are put back as plain values so that
  megatron's model config still knows the split is uneven (the layer counts themselves come from the hooks);
* :func:`megatron_validation_for_placement`: around megatron's ``parse_and_validate_args``, the flags given
  with a V / bidirectional schedule are hidden from megatron's ``validate_args`` and put back after: it would
  derive a virtual pipeline size from a layout string (and refuse it at ``--pipeline-model-parallel-size 2``)
  and assert, with a traceback, that the layers divide by the pipeline size (the plugin checks them against
  the placement's model stages instead, with a one-line refusal).

Loop placements (``1f1b``, ``zb-h1``, ``interleaved-1f1b``, ...) keep megatron's own meaning and checks.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

from ..schedules import registry
from ..schedules.schedule import Schedule
from ._patching import Patcher

LAYOUT_ATTR = "pipeline_model_parallel_layout"
SPLIT_ATTRS = (
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
    LAYOUT_ATTR,
)
_CONFIG_BUILDER = ("megatron.training.argument_utils", "core_transformer_config_from_args")


def selected_placement_style(args: Any) -> str | None:
    """The placement style of the schedule ``args`` select (None: megatron's own, ``auto``, or unreadable)."""
    name = getattr(args, "pipeline_schedule", None)
    if name:
        try:
            return registry.get(name).placement
        except (KeyError, ValueError):
            return None
    path = getattr(args, "pipeline_schedule_file", None)
    if path:
        try:
            return Schedule.load(path).placement.style
        except Exception:  # the normal checks report a bad file with its own message
            return None
    return None


def layout_is_ours(args: Any) -> bool:
    """Whether ``args``' ``--pipeline-model-parallel-layout`` maps onto a V / bidirectional placement's
    stages (ours to apply) rather than megatron's loop placement."""
    if getattr(args, LAYOUT_ATTR, None) is None:
        return False
    style = selected_placement_style(args)
    return style is not None and style != "loop"


# ---- megatron's validate_args ---------------------------------------------------------------------------
@contextlib.contextmanager
def megatron_validation_for_placement() -> Iterator[None]:
    """While active, megatron's ``validate_args`` does not see the uneven-split flags of a V / bidirectional
    schedule, nor checks its layer count against the pipeline size; the flags are back in ``args`` when it
    returns."""
    patcher = Patcher()
    try:
        import megatron.training.arguments as arguments_module
    except ImportError:  # pragma: no cover - megatron.training absent
        yield
        return
    original = arguments_module.validate_args

    def validate_args(args: Any, *rest: Any, **kwargs: Any) -> Any:
        style = selected_placement_style(args)
        if style is None or style == "loop":
            return original(args, *rest, **kwargs)
        saved = {attr: getattr(args, attr, None) for attr in SPLIT_ATTRS}
        for attr in SPLIT_ATTRS:
            setattr(args, attr, False if attr.startswith("account_for") else None)
        # megatron checks that --num-layers (plus the embedding / loss) divides by --pipeline-model-parallel-size
        # unless a first / last stage count is given: the split is over the placement's model stages (checked
        # later, with the flag and what would work), so that check is not megatron's here. A hybrid layer
        # pattern with "|" sets the stages itself, and megatron refuses a first-stage count beside it.
        if "|" not in (getattr(args, "hybrid_layer_pattern", None) or ""):
            args.decoder_first_pipeline_num_layers = 0
        try:
            return original(args, *rest, **kwargs)
        finally:
            for attr, value in saved.items():
                setattr(args, attr, value)

    patcher.replace("megatron.training.arguments", "validate_args", validate_args)
    try:
        yield
    finally:
        patcher.restore()


# ---- megatron's TransformerConfig -----------------------------------------------------------------------
def transformer_config_without_split(first: int | None, last: int | None) -> Any:
    """A ``core_transformer_config_from_args`` building the config without the uneven-split flags, then
    recording ``first`` / ``last`` (the first / last model stage's layers) on it."""
    import importlib

    original = getattr(importlib.import_module(_CONFIG_BUILDER[0]), _CONFIG_BUILDER[1])

    def core_transformer_config_from_args(args: Any, *rest: Any, **kwargs: Any) -> Any:
        plain = copy.copy(args)
        for attr in SPLIT_ATTRS:
            if hasattr(plain, attr):
                setattr(plain, attr, False if attr.startswith("account_for") else None)
        config = original(plain, *rest, **kwargs)
        # after __post_init__: plain values, read only by megatron's model config to know the split is
        # uneven (megatron's layer offsets and counts are the hooks', :mod:`.layout`)
        config.num_layers_in_first_pipeline_stage = first
        config.num_layers_in_last_pipeline_stage = last
        return config

    return core_transformer_config_from_args


def patch_transformer_config(patcher: Patcher, counts: list[int]) -> None:
    """Install :func:`transformer_config_without_split` for a split whose model stages hold ``counts``."""
    try:
        builder = transformer_config_without_split(counts[0], counts[-1])
        patcher.replace(*_CONFIG_BUILDER, builder)
    except ImportError:  # megatron.training absent: a user's own TransformerConfig is theirs
        pass


def mtp_layout_error(args: Any) -> str | None:
    """What is wrong with the multi-token prediction layers (``m``) of ``args``' ``--pipeline-model-parallel-layout``
    under a plugin schedule, any placement (megatron's own rules and the plugin's, ``schedules/layer_split.py``
    ``check_mtp_layers``), or None. Megatron would stop with an assertion on every rank (its rules), or the
    executor at the first message (an MTP stage before the loss)."""
    from ..schedules.layer_split import LayerSplitError, check_mtp_layers
    from ..schedules.values import parse_layer_layout

    text = getattr(args, LAYOUT_ATTR, None)
    if text is None:
        return None
    try:
        check_mtp_layers(parse_layer_layout(text), getattr(args, "mtp_num_layers", None))
    except (ValueError, LayerSplitError) as exc:
        return str(exc)
    return None
