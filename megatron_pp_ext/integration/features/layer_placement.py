"""The layer-layout feature: how megatron's layers are placed on the schedule's stages.

Checks (after the schedule is built): megatron's uneven-split flags (``--decoder-first/last-pipeline-num-layers``,
``--pipeline-model-parallel-layout``, ...) and a hybrid model's ``--hybrid-layer-pattern`` against the
schedule's placement, or the layer count dividing evenly into its stages; the split found is recorded in
the configuration. Activation: :mod:`..layout`'s hooks (for V and bidirectional placements, or forced by
``install(layout_hooks=True)`` / :data:`LAYOUT_HOOKS_ENV`), under which megatron builds the chunks the
schedule expects (:mod:`..uneven` for the split flags under those placements).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from ...schedules.layer_split import SPLIT_FLAGS
from ...schedules.placement import Placement
from ...schedules.schedule import Schedule
from .. import layout
from ..config import PipelineArgumentError
from ..uneven import layout_is_ours
from .base import Feature, Wiring, register

if TYPE_CHECKING:
    from .._patching import Patcher
    from ..config import PipelineConfig

LAYOUT_HOOKS_ENV = "MEGATRON_PP_EXT_LAYOUT_HOOKS"

VIRTUAL_FLAGS = (
    ("num_virtual_stages_per_pipeline_rank", "--num-virtual-stages-per-pipeline-rank"),
    ("num_layers_per_virtual_pipeline_stage", "--num-layers-per-virtual-pipeline-stage"),
    ("pipeline_model_parallel_layout", "--pipeline-model-parallel-layout"),
)
UNEVEN_FLAGS = SPLIT_FLAGS  # megatron's uneven-split flags (schedules/layer_split.py)


def given(args: Any, name: str) -> bool:
    value = getattr(args, name, None)
    return value is not None and value is not False


def virtual_flag_of(args: Any) -> str | None:
    """The virtual pipeline flag the user gave (a layout string mapped onto a V / bidirectional placement's
    stages is not one: :mod:`..uneven`)."""
    ours = layout_is_ours(args)
    for name, flag in VIRTUAL_FLAGS:
        if given(args, name) and not (ours and name == "pipeline_model_parallel_layout"):
            return flag
    return None


def layer_split_from_args(args: Any) -> Any:
    """Megatron's uneven-split flags as a :class:`~megatron_pp_ext.schedules.layer_split.LayerSplit`
    (raises ValueError on a layout string that does not parse)."""
    from ...schedules.layer_split import split_from_args

    return split_from_args(args)


def _check_uneven_split(args: Any, schedule: Schedule, given: list[str]) -> None:
    """Uneven splits under V / bidirectional placements: the flags split the placement's model stages."""
    from ...schedules.layer_split import LayerSplitError, stage_layer_counts

    flag = given[0]
    try:
        split = layer_split_from_args(args)
    except ValueError as exc:
        raise PipelineArgumentError("--pipeline-model-parallel-layout", str(exc)) from None
    num_layers = getattr(args, "num_layers", None)
    if num_layers is None:
        return
    placement = schedule.placement
    try:
        stage_layer_counts(num_layers, placement.stages_per_replica, split)
    except LayerSplitError as exc:
        where = (
            f"--pipeline-schedule {schedule.name}: {placement.style} placement, "
            f"{placement.stages_per_replica} model stages over {placement.num_ranks} ranks"
        )
        raise PipelineArgumentError(flag, f"{exc} ({where})") from None
    args.pipeline_layer_split = split


def _check_hybrid_pattern(args: Any, schedule: Schedule) -> None:
    """A hybrid layer pattern's segments against the schedule's placement (stage s builds segment s), and
    its layer types against what this run can build (``runtime/hybrid_pattern.py``)."""
    from ...runtime.hybrid_pattern import HybridPatternError, check_runnable, hybrid_layer_split

    flag, pattern = "--hybrid-layer-pattern", args.hybrid_layer_pattern
    try:
        split = hybrid_layer_split(pattern, schedule.placement, schedule.name, flag)
        if bool(getattr(args, "cpu", False)):
            from ..hybrid import LOCAL_SYMBOLS

            check_runnable(pattern, LOCAL_SYMBOLS, "on CPU (megatron-core's local layers)", flag)
            if "E" in pattern and getattr(args, "add_bias_linear", False):
                raise HybridPatternError(
                    f"{flag} MoE layers ('E') on CPU need --disable-bias-linear (megatron-core's expert bias "
                    "fails on CPU)"
                )
    except HybridPatternError as exc:
        raise PipelineArgumentError(flag, str(exc).removeprefix(f"{flag} ")) from None
    args.pipeline_layer_split = split


def _check_layers(args: Any, schedule: Schedule, virtual_flag: str | None) -> None:
    placement = schedule.placement
    if getattr(args, "hybrid_layer_pattern", None):
        _check_hybrid_pattern(args, schedule)
        return
    uneven = [flag for attr, flag in UNEVEN_FLAGS if given(args, attr)]
    layout_flag = "--pipeline-model-parallel-layout"
    if layout_flag in uneven and len(uneven) > 1:  # megatron's TransformerConfig refuses it with a traceback
        others = " / ".join(f for f in uneven if f != layout_flag)
        message = f"gives every stage's layers: not with {others} (give one or the other)"
        raise PipelineArgumentError(layout_flag, message)
    if uneven:
        from ..uneven import mtp_layout_error

        mtp_error = mtp_layout_error(args)
        if mtp_error:
            raise PipelineArgumentError(layout_flag, mtp_error)
        if placement.style == "loop":
            return  # megatron splits the layers itself (and checks them)
        if layout_flag in uneven and virtual_flag is not None:
            raise PipelineArgumentError(
                layout_flag,
                f"not with {virtual_flag}: under {schedule.name}'s {placement.style} placement the layout's stages "
                "are the placement's model stages, which fix the chunks per rank (leave the virtual flag out)",
            )
        _check_uneven_split(args, schedule, uneven)
        return
    num_layers = getattr(args, "num_layers", None)
    if num_layers is None:
        return
    stages = placement.stages_per_replica
    if num_layers % stages:
        raise PipelineArgumentError(
            "--num-layers",
            f"{num_layers} layers do not split evenly into the {stages} pipeline stages of {schedule.name} "
            f"({placement.style} placement: {placement.num_ranks} ranks x {placement.chunks_per_rank} chunk(s)); "
            f"use a multiple of {stages}",
        )


def wants_layout_hooks(placement: Placement, layout_hooks: bool | None) -> bool:
    """Layout hooks for every placement but megatron's own loop, or where forced on."""
    if layout_hooks is None:
        layout_hooks = os.environ.get(LAYOUT_HOOKS_ENV, "") == "1"
    return layout_hooks or placement.style != "loop"


class LayerPlacement(Feature):
    name = "layer-layout"
    megatron_flags = (*(flag for _, flag in SPLIT_FLAGS), "--hybrid-layer-pattern", "--num-layers")

    def check_schedule(self, args: Any, config: PipelineConfig, schedule: Schedule) -> None:
        _check_layers(args, schedule, virtual_flag_of(args))
        config.layer_split = getattr(args, "pipeline_layer_split", None)

    def activate(self, config: PipelineConfig, patcher: Patcher, wiring: Wiring) -> None:
        patcher.on_restore(layout.deactivate)  # on uninstall() always, as megatron's loop may have had them forced
        placement = wiring.placement
        if not wants_layout_hooks(placement, wiring.layout_hooks):
            return
        if config.num_layers is None:
            raise PipelineArgumentError(
                "--num-layers", f"{config.label} uses a {placement.style} placement: the layer count must be known"
            )
        layout.activate(placement, config.num_layers, config.layer_split)


register(LayerPlacement())
