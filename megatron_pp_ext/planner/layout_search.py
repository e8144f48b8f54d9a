"""The layout axis of the search: one candidate configuration evaluated under the uniform split and the
planned layouts (:func:`.layer_layouts.candidate_splits`); the best row of each kind is kept, so the table shows
what planning the layout gains over the uniform split of the same configuration."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from .evaluate import evaluate
from .layer_layouts import candidate_splits, split_from_layout
from .memory import split_layers
from .result import PlanRow
from .variants import Variant

if TYPE_CHECKING:
    from .search import Planner

__all__ = ["evaluate_layouts"]


def evaluate_layouts(
    planner: Planner, var: Variant, t: int, p: int, d: int, b: int, m: int, recompute: str, fsdp: bool
) -> list[PlanRow | float | str]:
    """Rows of one candidate: without the layout search (``--layer-split`` other than ``search``, or a run's
    own split) its one evaluation; with it the fastest fitting row of the uniform split and, when faster or
    when the uniform split does not fit or exist, of the planned layouts; else the smallest over-budget peak
    (bytes) or the first reason it does not apply."""
    if planner.space.layer_split != "search" or planner.space.given_split is not None:
        return [evaluate(planner, var, t, p, d, b, m, recompute, fsdp)]
    placement = var.schedule.placement
    if planner.space.layout is not None:  # one given layout: the candidates whose placement it fits
        try:
            given = split_from_layout(planner.space.layout, planner.model.num_layers, placement)
        except ValueError as exc:
            return [str(exc)]
        return [evaluate(planner, replace(var, split=given), t, p, d, b, m, recompute, fsdp)]
    table = planner.layer_table(b, t, recompute)
    weights = tuple(x.f + x.b + x.w for x in table.sequence())
    uniform = split_layers(planner.model.num_layers, placement.stages_per_replica, "auto")
    key = (placement.style, placement.num_ranks, placement.chunks_per_rank, placement.num_replicas, weights, uniform)
    splits = planner.memo_layouts.get(key)
    if splits is None:
        splits = planner.memo_layouts[key] = candidate_splits(placement, weights, uniform)
    results = [evaluate(planner, replace(var, split=s), t, p, d, b, m, recompute, fsdp) for s in splits]
    planner.stats["layouts simulated"] += len(splits)
    rows = [r for r in results if isinstance(r, PlanRow)]
    if not rows:
        over = [r for r in results if isinstance(r, float)]
        if over:
            return [min(over)]
        return [next(r for r in results if isinstance(r, str))] if results else ["no layout of the layers applies"]
    best: dict[bool, PlanRow] = {}
    for row in rows:
        planned = row.config.layout is not None
        if planned not in best or row.iteration_time < best[planned].iteration_time:
            best[planned] = row
    if True in best and False in best and best[True].iteration_time >= best[False].iteration_time:
        del best[True]  # a planned layout is listed only where it beats the uniform split
    return list(best.values())
