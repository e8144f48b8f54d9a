"""A planned layer layout against the uniform split on real runs, as arithmetic: how long the planner expects
each rank to be busy (its stages' per-layer costs times the micro-batches), what a run's tracer measured (the
per-rank summaries ``--pipeline-trace DIR`` writes) and the gains.

Read by ``benchmarks/bench_layout_cpu.py``, which runs the layouts through megatron's training loop and
compares. Pure Python (files and numbers; no torch, no megatron).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..schedules.placement import Placement
from .layer_costs import LayerCostTable, slice_costs
from .layer_layouts import rank_loads

__all__ = [
    "TracedRun",
    "agreement",
    "gain",
    "predicted_busy",
    "read_trace",
]


def predicted_busy(table: LayerCostTable, placement: Placement, split: Sequence[int], microbatches: int) -> list[float]:
    """Seconds each rank of ``placement`` computes in one iteration under ``split`` (layers per model slice):
    every micro-batch runs F, B and W of each stage the rank holds, so it is ``microbatches`` times the sum of
    those stages' per-layer costs (embedding on the first slice, output layer + loss on the last)."""
    per_slice = [x.f + x.b + x.w for x in slice_costs(table, split)]
    return [microbatches * load for load in rank_loads(placement, split, per_slice)]


@dataclass(frozen=True)
class TracedRun:
    """One traced run, over its iterations after the warm-up: per rank, the median seconds spent in compute
    ops (``busy_s``); the median over iterations of the slowest rank's ``forward_backward`` call (``step_s``)."""

    busy: tuple[float, ...]
    step: float
    iterations: int


def read_trace(directory: str | Path, num_ranks: int, skip: int) -> TracedRun:
    """The tracer's ``summary_rank{R}.json`` files of one run (one pipeline), iterations after the first
    ``skip``. ValueError naming the file when one is missing or has no iteration after the warm-up."""
    per_rank: list[list[dict[str, float]]] = []
    for rank in range(num_ranks):
        path = Path(directory) / f"summary_rank{rank}.json"
        try:
            iterations = json.loads(path.read_text())["per_iteration"][skip:]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"trace summary {path}: {exc}") from None
        if not iterations:
            raise ValueError(f"trace summary {path}: no iteration after the first {skip}")
        per_rank.append(iterations)
    count = min(len(x) for x in per_rank)
    busy = tuple(statistics.median(float(it["busy_s"]) for it in iterations[:count]) for iterations in per_rank)
    step = statistics.median(max(float(iterations[i]["step_time_s"]) for iterations in per_rank) for i in range(count))
    return TracedRun(busy, step, count)


def gain(uniform: float, planned: float) -> float:
    """The share of the uniform layout's time the planned one saves (0.2: 20% faster; negative: slower)."""
    if not uniform > 0:
        raise ValueError(f"the uniform layout's time must be > 0, got {uniform!r}")
    return 1.0 - planned / uniform


def agreement(measured_gain: float, predicted_gain: float) -> float:
    """Measured gain / predicted gain (1.0: the prediction held); NaN where nothing was predicted."""
    return measured_gain / predicted_gain if predicted_gain != 0 and math.isfinite(predicted_gain) else math.nan
