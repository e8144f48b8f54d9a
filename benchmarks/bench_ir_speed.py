"""Speed of the pure-Python core on a large schedule: generate, lower, validate, simulate.

    python benchmarks/bench_ir_speed.py [--name interleaved-1f1b] [-p 64] [-m 1024] [-v 2] [--repeats 3]

Reports the best of ``repeats`` runs (CPU seconds of this process, and wall seconds).
"""

from __future__ import annotations

import argparse
import time

from megatron_pp_ext.analysis.schedule_check import validate
from megatron_pp_ext.analysis.simulate import simulate
from megatron_pp_ext.schedules import generate, lower


def once(name: str, p: int, m: int, v: int | None) -> dict[str, tuple[float, float]]:
    phases: dict[str, tuple[float, float]] = {}
    clock = (time.process_time(), time.perf_counter())

    def lap(label: str) -> None:
        nonlocal clock
        now = (time.process_time(), time.perf_counter())
        phases[label] = (now[0] - clock[0], now[1] - clock[1])
        clock = now

    schedule = generate(name, p, m, v=v)
    lap("generate")
    lowered = lower(schedule)
    lap("lower")
    validate(schedule)  # reuses the cached lowering
    lap("validate")
    simulate(schedule, lowered=lowered)
    lap("simulate")
    phases["total"] = (sum(c for c, _ in phases.values()), sum(w for _, w in phases.values()))
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--name", default="interleaved-1f1b")
    parser.add_argument("-p", type=int, default=64)
    parser.add_argument("-m", type=int, default=1024)
    parser.add_argument("-v", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    runs = [once(args.name, args.p, args.m, args.v) for _ in range(args.repeats)]
    ops = sum(len(row) for row in generate(args.name, args.p, args.m, v=args.v).ops)
    print(f"| phase ({args.name}, p={args.p}, m={args.m}, v={args.v}, {ops} ops) | CPU s (best) | wall s (best) |")
    print("| --- | --- | --- |")
    for phase in runs[0]:
        print(f"| {phase} | {min(r[phase][0] for r in runs):.3f} | {min(r[phase][1] for r in runs):.3f} |")


if __name__ == "__main__":
    main()
