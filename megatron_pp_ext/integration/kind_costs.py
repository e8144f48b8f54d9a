"""Per-layer-kind costs (``--pipeline-costs KIND=F,B,W;...``) as the per-stage costs a named schedule is built
with.

A cost-aware generator (zb-auto, v-zb, ...) takes each stage's F, B, W; per-kind costs give one layer's. Each
stage of the run's placement sums the kinds of the layers it holds under the run's split (megatron's uneven-split
flags, or a hybrid pattern's ``|`` segments), the embedding on the first model stage and the output layer + loss
(``head``) on the last (:func:`~megatron_pp_ext.schedules.kind_profile.stage_kind_counts`), each kind's times
scaled linearly from the costs' micro-batch size and TP to the run's, as the planner scales measured layer times.
The p2p cost is 0 (per-kind text has none). ``--pipeline-schedule auto`` reads per-kind costs itself (the planner).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from ..schedules import registry
from ..schedules.kind_profile import stage_kind_counts, stage_times
from ..schedules.layer_split import LayerSplit, LayerSplitError, split_from_args
from ..schedules.placement import make_placement
from ..schedules.values import layer_costs_scale
from .config import LayerKindCosts, PipelineArgumentError

__all__ = ["layer_kinds", "with_stage_costs"]

FLAG = "--pipeline-costs"


def layer_kinds(args: Any) -> tuple[str, ...] | None:
    """The run's decoder layers by cost kind, in model order: a hybrid pattern's symbols, else ``dense``;
    ``None`` where a layer has no cost kind (MoE GPT layers, hybrid symbols outside ``M * - E``)."""
    pattern = getattr(args, "hybrid_layer_pattern", None)
    if pattern:
        from ..planner.models import HYBRID_KINDS

        symbols = pattern.split("/")[0].replace("|", "")  # the decoder's layers (an MTP part is none)
        if not set(symbols) <= set(HYBRID_KINDS):
            return None
        return tuple(HYBRID_KINDS[c] for c in symbols)
    if getattr(args, "num_experts", None) or not getattr(args, "num_layers", None):
        return None
    return ("dense",) * int(args.num_layers)


def _split(args: Any, placement: Any, schedule: str) -> LayerSplit:
    pattern = getattr(args, "hybrid_layer_pattern", None)
    if pattern:
        from ..runtime.hybrid_pattern import hybrid_layer_split

        return hybrid_layer_split(pattern, placement, schedule)
    return split_from_args(args)


def with_stage_costs(args: Any, costs: LayerKindCosts, schedule: str, p: int, v: int | None) -> LayerKindCosts:
    """``costs`` with the per-stage costs of ``schedule`` at pipeline size ``p`` (``v`` chunks per rank where
    given) under this run's layers; :class:`PipelineArgumentError` naming ``--pipeline-costs`` where the run's
    stages are not determined or hold a kind the costs lack."""
    from ..schedules.costs import Costs

    kinds = layer_kinds(args)
    if kinds is None:
        raise PipelineArgumentError(
            FLAG,
            "per-layer-kind costs need every layer's kind (dense GPT layers, or a hybrid pattern of M * - E); give "
            "F,B,W[,COMM] of one stage instead",
        )
    info = registry.get(schedule)
    default_v = info.capabilities.chunks.default
    placement = make_placement(info.placement, p, v or default_v)
    try:
        counts = stage_kind_counts(kinds, placement, _split(args, placement, schedule))
    except (LayerSplitError, ValueError) as exc:  # a split flag that does not fit this placement
        raise PipelineArgumentError(FLAG, f"per-layer-kind costs: this run's layers per stage: {exc}") from None
    run_micro_batch = int(getattr(args, "micro_batch_size", None) or costs.micro_batch)
    run_tp = int(getattr(args, "tensor_model_parallel_size", None) or 1)
    scale = layer_costs_scale(run_micro_batch, run_tp, costs.micro_batch, costs.tp)
    per_kind = {kind: tuple(x * scale for x in times) for kind, times in costs.entries}
    try:
        times = stage_times(counts, per_kind)
    except ValueError as exc:
        raise PipelineArgumentError(
            FLAG,
            f"{exc}: give every kind the stages hold (KIND=F,B,W;..., e.g. the 'layer_costs' of a profile written "
            "by --pipeline-profile-out) or F,B,W[,COMM] of one stage",
        ) from None
    f, b, w = (tuple(stage[i] for stage in times) for i in range(3))
    return replace(costs, profile=Costs(t_f=f, t_b=b, t_w=w, t_comm=0.0))
