"""Zero-bubble schedules in the simulator: bubble rates, peak activations, zb-auto generation time.

Prints markdown tables (one per cost model) of 1F1B, ZB-H1, ZB-H2 and zb-auto with memory limits
``p`` and ``2p``, then the time to generate zb-auto for p=32, m=256 (best and median of a few runs, wall-clock
and CPU time, with the load average: the machine is shared, so wall-clock time varies a lot).

* ``bubble_rate``: the zero-bubble paper's, ``(C - m(T_F+T_B+T_W)) / C`` with ``C`` the longest
  per-rank span (first op start to last op end);
* ``sync_bubble_rate``: the same with the global makespan (a synchronous optimizer step);
* peak activations: worst rank, in stage activations (= 1F1B units here: one chunk per rank),
  an activation counted live from its F until its W (the simulator's default).

    python benchmarks/bench_zero_bubble.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from megatron_pp_ext.analysis import simulate
from megatron_pp_ext.schedules import generate
from megatron_pp_ext.schedules.costs import Costs

COST_MODELS = {
    "unit costs (T_F = T_B = T_W = 1, T_comm = 0)": Costs.unit(),
    "unequal costs (T_F = 1.0, T_B = 1.1, T_W = 0.6, T_comm = 0.05)": Costs(1.0, 1.1, 0.6, None, 0.05),
}
SHAPES = [(4, 4), (4, 8), (4, 16), (8, 8), (8, 16), (8, 32), (16, 32), (16, 64), (32, 96)]


def rows_for(p: int, m: int, costs: Costs) -> list[list[str]]:
    cases: list[tuple[str, str, dict[str, object]]] = [
        ("1f1b", "-", {}),
        ("zb-h1", "-", {}),
        ("zb-h2", "-", {}),
        ("zb-auto", "p", {"costs": costs, "memory_limit": p}),
        ("zb-auto", "2p", {"costs": costs, "memory_limit": 2 * p}),
    ]
    out = []
    for name, limit, kwargs in cases:
        schedule = generate(name, p, m, **kwargs)
        result = simulate(schedule, costs)
        candidate = str(schedule.params.get("candidate", ""))
        out.append(
            [
                str(p),
                str(m),
                name + (f" ({limit})" if limit != "-" else ""),
                f"{result.makespan:.2f}",
                f"{result.bubble_rate:.4f}",
                f"{result.sync_bubble_rate:.4f}",
                f"{max(result.peak_activations):g}",
                candidate,
            ]
        )
    return out


def table(rows: list[list[str]]) -> str:
    header = ["p", "m", "schedule (memory limit)", "makespan", "bubble_rate", "sync_bubble_rate", "peak act", "picked"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def generation_time(runs: int) -> str:
    lines = []
    for label, costs in (("unit costs", None), ("unequal costs", Costs(1.0, 1.1, 0.6, None, 0.05))):
        wall, cpu = [], []
        for _ in range(runs):
            start, start_cpu = time.perf_counter(), time.process_time()
            schedule = generate("zb-auto", 32, 256, costs=costs)
            wall.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
        lines.append(
            f"zb-auto p=32 m=256, {label}, limit 2p (picked {schedule.params['candidate']}): wall best "
            f"{min(wall):.2f} s, median {statistics.median(wall):.2f} s; CPU best {min(cpu):.2f} s, median "
            f"{statistics.median(cpu):.2f} s; {runs} runs, {os.cpu_count()} CPUs, load average {load}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="zb-auto p=32 m=256 generations to time")
    args = parser.parse_args()
    for title, costs in COST_MODELS.items():
        print(f"#### {title}\n")
        rows = [row for p, m in SHAPES for row in rows_for(p, m, costs)]
        print(table(rows))
        print()
    print(generation_time(args.runs))


if __name__ == "__main__":
    main()
