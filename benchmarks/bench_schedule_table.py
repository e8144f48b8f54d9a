"""The README's schedule table: simulated bubble and activation memory of every registered schedule.

Unit costs (T_F = T_B = T_W = 1, zero communication), p = 8, m = 32 (and v = 2 where a schedule
takes virtual stages). Peak activation memory is the worst rank's, in units of one 1F1B stage's
activation for one micro-batch (M_a).

    python benchmarks/bench_schedule_table.py [-p 8] [-m 32]
"""

from __future__ import annotations

import argparse

from megatron_pp_ext.analysis.schedule_check import validate
from megatron_pp_ext.analysis.simulate import simulate
from megatron_pp_ext.schedules import registry
from megatron_pp_ext.schedules.ir import ScheduleError


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("-p", type=int, default=8)
    parser.add_argument("-m", type=int, default=32)
    args = parser.parse_args()
    p, m = args.p, args.m
    print(
        "| schedule | placement | B/W split | bubble rate | sync bubble rate | peak activations (M_a) | p2p messages |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in registry.names():
        info = registry.get(name)
        try:
            schedule = registry.generate(name, p, m, v=2 if name == "interleaved-1f1b" else None)
        except (ScheduleError, TypeError) as exc:
            print(f"| {name} | {info.placement} | {'yes' if info.splits_backward else 'no'} | n/a: {exc} | | | |")
            continue
        result = simulate(schedule, lowered=validate(schedule))
        print(
            f"| {name} | {info.placement} | {'yes' if info.splits_backward else 'no'} | {result.bubble_rate:.4f} "
            f"| {result.sync_bubble_rate:.4f} | {max(result.peak_activations_1f1b_units):g} | {result.p2p_messages} |"
        )
    print(f"\np={p}, m={m}, unit costs, zero communication; interleaved-1f1b with v=2.")


if __name__ == "__main__":
    main()
