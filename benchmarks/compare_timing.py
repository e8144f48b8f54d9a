"""Exact timing figures over a grid, to compare the timing core before and after a change.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/compare_timing.py --write /tmp/before.json
    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/compare_timing.py --check /tmp/before.json

For every case of the golden grid (``tests/schedules/golden.py``) under two cost sets, it records
the simulator's per-op start times, makespan, spans, busy times and peaks under ``comm="async"``
and ``comm="blocking"``, with overlap pairs (``overlap=0.5``) where the schedule has them, with
a data-parallel stream (``dp=2``, gradient reduction, and FSDP with one gathered chunk), and the
engine's :func:`~megatron_pp_ext.schedules.order_timing.replay` timing of the same order. Floats are
kept exactly (``repr``); ``--check`` reports every difference and exits 1 if there is one.
"""

from __future__ import annotations

import json
from typing import Any

from snapshot_check import write_or_check

from megatron_pp_ext.analysis.schedule_check import ScheduleValidationError
from megatron_pp_ext.analysis.simulate import simulate
from megatron_pp_ext.schedules import generate
from megatron_pp_ext.schedules.collectives import CollectivePolicy
from megatron_pp_ext.schedules.costs import Costs, stage_costs
from megatron_pp_ext.schedules.ir import OpKind, ScheduleError
from megatron_pp_ext.schedules.order_timing import replay
from tests.schedules import golden

COSTS = {"unit": Costs(1.0, 1.0, 1.0, None, 0.0), "fbw-comm": Costs(1.0, 1.5, 0.7, None, 0.1)}


def _figures(result: Any) -> dict[str, Any]:
    out = {
        "makespan": result.makespan,
        "span": result.span,
        "busy": result.busy,
        "peak": result.peak_activations,
        "starts": result.starts,
    }
    if result.data_parallel is not None:
        dp = result.data_parallel
        out["dp"] = [dp.end, dp.stall, dp.tail, [list(c[3:]) for c in dp.collectives]]
    return out


def _case(name: str, p: int, m: int, kwargs: dict[str, Any], costs: Costs) -> dict[str, Any]:
    schedule = generate(name, p, m, **kwargs)
    row: dict[str, Any] = {"async": _figures(simulate(schedule, costs))}
    try:
        row["blocking"] = _figures(simulate(schedule, costs, comm="blocking"))
    except (ScheduleValidationError, ValueError) as exc:
        row["blocking"] = type(exc).__name__
    if any(schedule.overlap_pairs):
        row["overlap"] = _figures(simulate(schedule, costs, overlap=0.5))
    params = {"dp": 2, "dp_bandwidth": 4.0, "param_bytes": 3.0}
    row["dp"] = _figures(simulate(schedule, costs, **params))  # type: ignore[arg-type]
    try:
        fsdp = CollectivePolicy(fsdp_max_unsharded=1)
        row["fsdp"] = _figures(simulate(schedule, costs, collectives=fsdp, **params))  # type: ignore[arg-type]
    except (ScheduleError, ValueError) as exc:
        row["fsdp"] = type(exc).__name__
    placement = schedule.placement
    if placement.num_replicas == 1 and not any(op.kind is OpKind.BW for row in schedule.ops for op in row):
        try:
            t = replay(placement, m, stage_costs(costs, schedule.num_stages), schedule.ops)
            row["replay"] = [t.makespan, t.spans, t.busy, t.peaks]
        except (AssertionError, IndexError, ValueError) as exc:
            row["replay"] = type(exc).__name__
    return row


def collect() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, name, p, m, kwargs, _ in golden.cases():
        for label, costs in COSTS.items():
            out[f"{key}/{label}"] = _case(name, p, m, kwargs, costs)
    return out


def main() -> None:
    write_or_check(__doc__ or "", lambda: json.loads(json.dumps(collect())), "cases")  # the stored float round trip


if __name__ == "__main__":
    main()
