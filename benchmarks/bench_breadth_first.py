"""Breadth-first pipeline parallelism: bubble table and data-parallel exposure (simulator).

(a) Unit costs (T_F = T_B = T_W = 1 per stage, no communication): bubble rate of ``bfs``,
    ``bfs-zb``, ``interleaved-1f1b`` and ``1f1b`` over p = 4, 8, m = p .. 4p, v = 2, 4, next to
    the REFERENCES formula (p-1)/(v m + p-1) (derived there for breadth-first looped, m >= p).
(b) The paper's setting: small batch per GPU, so that the data-parallel reduction of a rank's
    gradients is comparable to the rank's compute for the whole batch. One 1F1B stage costs
    T_F = T_B = T_W = 1 ms per micro-batch (a looped chunk 1/v of that); a rank's parameters
    (1/p of the model, split evenly over its chunks) are sized so that a ring all-reduce of them
    over ``--dp`` ranks at ``--gbps`` takes ``ratio`` x 3m ms (the rank's compute for the batch).
    Reported: iteration time (ms, the pipeline plus the data-parallel streams' drain), the worst
    rank's exposed data-parallel time (ms: waits for gathers + drain after its last op) and FSDP
    all-gathers per rank per iteration, for plain DP (all-reduce per chunk), the distributed
    optimizer (reduce-scatter + parameter gather per chunk) and FSDP (one gathered chunk at a time).

    PYTHONPATH=. python benchmarks/bench_breadth_first.py [--dp 8] [--gbps 25] [--ratio 0.5 1]
"""

from __future__ import annotations

import argparse

from megatron_pp_ext.analysis.schedule_check import validate
from megatron_pp_ext.analysis.simulate import SimResult, simulate
from megatron_pp_ext.schedules import generate
from megatron_pp_ext.schedules.collectives import policy_for
from megatron_pp_ext.schedules.costs import Costs
from megatron_pp_ext.schedules.ir import ScheduleError
from megatron_pp_ext.schedules.schedule import Schedule

SCHEDULES = ("bfs", "bfs-zb", "interleaved-1f1b", "1f1b")
SETUPS = (("DP", {}), ("dist-opt", {"distributed_optimizer": True}), ("FSDP", {"fsdp": True}))


def _build(name: str, p: int, m: int, v: int) -> Schedule | None:
    try:
        return generate(name, p, m, v=None if name == "1f1b" else v)
    except ScheduleError:
        return None


def bubble_table() -> None:
    print("| p | m | v | formula (p-1)/(vm+p-1) | bfs | bfs-zb | interleaved-1f1b | 1f1b (p-1)/(m+p-1) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for p in (4, 8):
        for m in sorted({p, p + 1, 3 * p // 2, 2 * p, 2 * p + 1, 3 * p, 4 * p}):
            for v in (2, 4):
                cells = []
                for name in SCHEDULES:
                    schedule = _build(name, p, m, v)
                    if schedule is None:
                        cells.append("n/a")
                        continue
                    rate = simulate(schedule, Costs.unit(), lowered=validate(schedule)).sync_bubble_rate
                    cells.append(f"{rate:.4f}")
                formula = (p - 1) / (v * m + p - 1)
                print(f"| {p} | {m} | {v} | {formula:.4f} | " + " | ".join(cells) + " |")


def dp_run(
    name: str, p: int, m: int, v: int, dp: int, gbps: float, ratio: float, setup: dict[str, bool]
) -> SimResult | None:
    schedule = _build(name, p, m, v)
    if schedule is None:
        return None
    chunks = schedule.placement.stages_per_rank_per_replica
    unit = 1.0 / chunks  # ms per op of one stage (a 1F1B stage = 1 ms)
    bandwidth = gbps * 1e6  # bytes per ms
    rank_bytes = ratio * 3 * m * bandwidth / (2 * (dp - 1) / dp)  # all-reduce of a rank = ratio x 3m ms
    policy = policy_for(schedule, **setup)
    return simulate(
        schedule,
        Costs(unit, unit, unit, None, 0.0),
        lowered=validate(schedule),
        collectives=policy,
        dp=dp,
        dp_bandwidth=bandwidth,
        param_bytes=rank_bytes / chunks,
    )


def dp_table(dp: int, gbps: float, ratios: list[float]) -> None:
    for ratio in ratios:
        print(
            f"\n#### all-reduce of a rank's gradients = {ratio:g} x its compute for the batch (3m ms); "
            f"dp={dp}, {gbps:g} GB/s\n"
        )
        header = "| p | m | v | schedule | no DP (ms) |"
        rule = "| --- | --- | --- | --- | --- |"
        for label, _ in SETUPS:
            header += f" {label}: iteration / exposed (ms) |"
            rule += " --- |"
        header += " FSDP gathers per rank |"
        rule += " --- |"
        print(header)
        print(rule)
        for p, m in ((4, 4), (4, 8), (8, 8), (8, 16)):
            for v in (2, 4):
                for name in SCHEDULES:
                    if name == "1f1b" and v != 2:
                        continue
                    cells, gathers, compute = [], "", ""
                    for label, setup in SETUPS:
                        result = dp_run(name, p, m, v, dp, gbps, ratio, setup)
                        if result is None or result.data_parallel is None:
                            cells.append("n/a")
                            continue
                        data = result.data_parallel
                        plain = simulate(_build(name, p, m, v), result.costs)  # type: ignore[arg-type]
                        compute = f"{plain.makespan:.1f}"
                        cells.append(f"{data.iteration_time:.1f} / {max(data.exposed):.1f}")
                        if label == "FSDP":
                            gathers = f"{max(data.gathers(r) for r in range(p))}"
                    shown_v = 1 if name == "1f1b" else v
                    print(f"| {p} | {m} | {shown_v} | {name} | {compute} | " + " | ".join(cells) + f" | {gathers} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--gbps", type=float, default=25.0)
    parser.add_argument("--ratio", type=float, nargs="+", default=[0.5, 1.0])
    args = parser.parse_args()
    print("### (a) unit-cost sync bubble rate (global makespan; equals the per-rank-span rate for these)\n")
    bubble_table()
    print("\n### (b) data-parallel collectives on a stream per rank (the paper's small-batch setting)")
    dp_table(args.dp, args.gbps, args.ratio)


if __name__ == "__main__":
    main()
