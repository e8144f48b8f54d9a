"""BitPipe in the simulator, next to 1F1B, interleaved 1F1B (v=2), V-Half and V-ZB.

Prints markdown tables:

1. unit costs (``T_F = T_B = T_W = 1`` per stage of each schedule, so ``T_BW = 2``; ``T_comm = 0``),
   p in {4, 8, 16}, m in {p, 2p, 3p, 4p}: the bubble rate (zero-bubble paper's, per-rank span), the
   literature's formula where one exists, and the worst rank's peak activations in 1F1B-stage units
   ``M_a`` (a V or BitPipe stage holds half a 1F1B stage's layers: its activation is ``M_a / 2``);
2. ``bitpipe`` with ``T_F = T_BW`` (the derived formula's assumption) against ``(p-2)/(4m+p-2)``, and
   its per-rank peak in half-stage units against ``3p/2 + 1 + min(r, p-1-r)``;
3. exposed replica-sync time: every rank all-reduces each of its 4 chunks' gradients with its mirror
   rank ``p-1-r`` (:func:`~megatron_pp_ext.schedules.collectives.derive_collectives` with
   ``replica_sync=True``), one all-reduce at a time per pair, ``T_sync`` each. *Eager*: each starts at
   the gap the plan gives it (no earlier than the chunk's last gradient op on both ranks) on a stream
   that overlaps compute; *at the end*: all four start when both ranks of the pair have finished.
   Exposed = iteration end - compute makespan. The simulator has no data-parallel stream yet, so
   this is computed here from the simulated timeline.

    python benchmarks/bench_bitpipe.py
"""

from __future__ import annotations

import argparse

from megatron_pp_ext.analysis import SimResult, simulate
from megatron_pp_ext.schedules import Schedule, generate, lower
from megatron_pp_ext.schedules.collectives import CollectiveKind, CollectivePolicy, derive_collectives, mirror_rank
from megatron_pp_ext.schedules.costs import Costs

SCHEDULES = ("1f1b", "interleaved-1f1b", "v-half", "v-zb", "bitpipe", "bitpipe-zb")


def formula(name: str, p: int, m: int) -> str:
    if name == "1f1b":
        return f"{(p - 1) / (m + p - 1):.4f}"
    if name == "interleaved-1f1b":
        return f"{(p - 1) / (2 * m + p - 1):.4f}"
    if name == "bitpipe":
        return f"{(p - 2) / (4 * m + p - 2):.4f} (T_F=T_BW)"
    return {"v-half": "~1/2 of 1F1B's", "v-zb": "~0", "bitpipe-zb": "-"}[name]


def run(name: str, p: int, m: int, costs: Costs) -> tuple[Schedule, SimResult]:
    schedule = generate(name, p, m)
    return schedule, simulate(schedule, costs, lowered=lower(schedule))


def main_table(ps: list[int]) -> list[str]:
    lines = [
        "| p | m | schedule | bubble_rate | formula | peak act, worst rank (M_a) |",
        "|---|---|---|---|---|---|",
    ]
    for p in ps:
        for m in range(p, 4 * p + 1, p):
            for name in SCHEDULES:
                _, result = run(name, p, m, Costs.unit())
                peak = max(result.peak_activations_1f1b_units)
                lines.append(f"| {p} | {m} | {name} | {result.bubble_rate:.4f} | {formula(name, p, m)} | {peak:g} |")
    return lines


def bitpipe_table(ps: list[int]) -> list[str]:
    lines = [
        "| p | m | bubble T_F=T_BW | (p-2)/(4m+p-2) | bubble unit costs | peak per rank (half-stage units) | "
        "3p/2+1+min(r,p-1-r) |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in ps:
        derived = [3 * p // 2 + 1 + min(r, p - 1 - r) for r in range(p)]
        for m in range(p, 4 * p + 1, p):
            _, equal = run("bitpipe", p, m, Costs(1.0, 1.0, 1.0, t_bw=1.0))
            _, unit = run("bitpipe", p, m, Costs.unit())
            peaks = ",".join(f"{x:g}" for x in unit.peak_activations)
            lines.append(
                f"| {p} | {m} | {equal.bubble_rate:.4f} | {(p - 2) / (4 * m + p - 2):.4f} | {unit.bubble_rate:.4f} | "
                f"{peaks} | {','.join(map(str, derived))} |"
            )
    return lines


def exposed_sync(schedule: Schedule, result: SimResult, t_sync: float) -> tuple[float, float]:
    """(exposed with eager sync, exposed with every sync at the end), worst replica pair."""
    plan = derive_collectives(schedule, CollectivePolicy(reduce_grads=False, replica_sync=True))
    durations = result.durations
    assert durations is not None
    p = schedule.num_ranks
    gap_time = []  # per rank: time of gap i = end of op i-1 (0 for gap 0)
    for rank, row in enumerate(schedule.ops):
        ends = [start + durations.of(op) for op, start in zip(row, result.starts[rank], strict=True)]
        gap_time.append([0.0, *ends])
    eager_end = lazy_end = 0.0
    for rank in range(p):
        other = mirror_rank(p, rank)
        if other < rank:
            continue
        mine = [gap for gap, c in plan.at[rank] if c.kind == CollectiveKind.REPLICA_SYNC]
        theirs = [gap for gap, c in plan.at[other] if c.kind == CollectiveKind.REPLICA_SYNC]
        clock = 0.0
        for a, b in zip(mine, theirs, strict=True):
            clock = max(clock, gap_time[rank][a], gap_time[other][b]) + t_sync
        eager_end = max(eager_end, clock)
        lazy_end = max(lazy_end, max(gap_time[rank][-1], gap_time[other][-1]) + len(mine) * t_sync)
    return max(0.0, eager_end - result.makespan), max(0.0, lazy_end - result.makespan)


def sync_table(ps: list[int], t_syncs: list[float]) -> list[str]:
    lines = [
        "| schedule | p | m | T_sync | makespan | exposed, eager | exposed, all at the end | saved |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in ("bitpipe", "bitpipe-zb"):
        for p in ps:
            for m in (p, 4 * p):
                schedule, result = run(name, p, m, Costs.unit())
                for t_sync in t_syncs:
                    eager, lazy = exposed_sync(schedule, result, t_sync)
                    lines.append(
                        f"| {name} | {p} | {m} | {t_sync:g} | {result.makespan:g} | {eager:g} | {lazy:g} | "
                        f"{lazy - eager:g} |"
                    )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ps", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--t-sync", type=float, nargs="+", default=[2.0, 8.0])
    args = parser.parse_args()
    print("#### unit costs (T_F = T_B = T_W = 1 per stage, T_comm = 0)\n")
    print("\n".join(main_table(args.ps)))
    print("\n#### bitpipe: derived formulas\n")
    print("\n".join(bitpipe_table(args.ps)))
    print("\n#### exposed replica-sync time (unit costs; T_sync = one chunk's all-reduce)\n")
    print("\n".join(sync_table(args.ps, args.t_sync)))


if __name__ == "__main__":
    main()
