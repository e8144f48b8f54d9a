"""V-shape schedules in the simulator: V-Min, V-Half, V-ZB against 1F1B (same p, m and costs).

Prints markdown tables (one per cost model) for p in {4, 8, 16} and m in {2p, 4p}:

* ``bubble_rate``: the zero-bubble paper's, ``(C - busy) / C`` with ``C`` the longest per-rank span
  (first op start to last op end); ``sync_bubble_rate``: the same over the global makespan;
* ``vs 1F1B``: bubble_rate over 1F1B's; ``idle vs 1F1B``: the idle time in the longest span per
  micro-batch of work, ``(C - busy) / (busy / m)``, over 1F1B's (scale-free, so the V schedules'
  half-size stages compare directly; an exact half of 1F1B's idle time gives a rate ratio of about
  0.55 at these m because the rates' denominators include the bubble);
* peak activations: worst rank, in 1F1B-stage units M_a (a V stage's activation is M_a / 2),
  counted live from F until W (the simulator's default), and its ratio to 1F1B's;
* for v-zb, its ideal bubble rate (every pass starts once its input exists) next to the
  one the lowered program gives (the simulator's, which is also the generator's own prediction);
* then the building blocks' lifespan and memory figures (``block_info``).

    python benchmarks/bench_vshape.py
"""

from __future__ import annotations

import argparse

from megatron_pp_ext.analysis import SimResult, simulate
from megatron_pp_ext.schedules import generate, lower
from megatron_pp_ext.schedules.costs import Costs
from megatron_pp_ext.schedules.generators.building_block import block_info

COST_MODELS = {
    "unit costs (T_F = T_B = T_W = 1 per stage, T_comm = 0)": Costs.unit(),
    "unequal costs (T_F = 3, T_B = 4, T_W = 2 per stage, T_comm = 0)": Costs(3.0, 4.0, 2.0),
}
SCHEDULES = ("1f1b", "v-min", "v-half", "v-zb")


def _idle_per_microbatch(result: SimResult) -> float:
    span, busy = max(result.span), max(result.busy)
    return (span - busy) / (busy / result.m)


def table(costs: Costs, ps: list[int]) -> list[str]:
    lines = [
        "| p | m | schedule | bubble_rate | sync_bubble_rate | vs 1F1B | idle vs 1F1B | peak act (M_a) | "
        "memory vs 1F1B | v-zb ideal bubble |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in ps:
        for m in (2 * p, 4 * p):
            base: SimResult | None = None
            for name in SCHEDULES:
                kwargs = {"costs": costs} if name == "v-zb" else {}
                schedule = generate(name, p, m, **kwargs)
                result = simulate(schedule, costs, lowered=lower(schedule))
                if base is None:
                    base = result
                peak = max(result.peak_activations_1f1b_units)
                ideal = f"{schedule.params['ideal_bubble_rate']:.4f}" if name == "v-zb" else ""
                lines.append(
                    f"| {p} | {m} | {name} | {result.bubble_rate:.4f} | {result.sync_bubble_rate:.4f} | "
                    f"{result.bubble_rate / base.bubble_rate:.2f} | "
                    f"{_idle_per_microbatch(result) / _idle_per_microbatch(base):.2f} | {peak:g} | "
                    f"{peak / max(base.peak_activations_1f1b_units):.2f} | {ideal} |"
                )
    return lines


def block_table(ps: list[int]) -> list[str]:
    lines = [
        "| p | block | interval | lifespan (slots) | max activation lifespan c0+c1 | memory bound (M_a) | "
        "steady-state peak (M_a) |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in ps:
        for name in ("v-min", "v-half"):
            info = block_info(name, p)
            longest = max(a + b for a, b in info.activation_lifespans)
            lines.append(
                f"| {p} | {name} | {info.interval} | {info.lifespan} | {longest} | {info.memory_bound:g} | "
                f"{info.peak:g} |"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-p", type=int, nargs="*", default=[4, 8, 16], help="pipeline sizes (default 4 8 16)")
    args = parser.parse_args()
    for title, costs in COST_MODELS.items():
        print(f"#### {title}\n")
        print("\n".join(table(costs, args.p)))
        print()
    print("#### building blocks (`block_info`)\n")
    print("\n".join(block_table(args.p)))


if __name__ == "__main__":
    main()
