"""``megatron-pp compare``: every registered schedule that applies at ``(p, m, v)``, side by side."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from .. import argtypes
from ..schedule_args import CliError, generate_schedule, parse_cli_costs
from ..schedules import registry
from ..schedules.ir import ScheduleError
from ..schedules.schedule import Schedule
from .cmd_simulate import simulated
from .formatting import fmt_table, num

if TYPE_CHECKING:
    from ..analysis.simulate import SimResult
    from ..schedules.costs import Costs


def compare_rows(
    p: int, m: int, v: int | None, costs: Costs | None
) -> tuple[list[tuple[Schedule, SimResult]], dict[str, str], dict[str, str]]:
    """Simulate every registered schedule that can be built for ``(p, m, v)``.

    Returns the results, the schedules whose generator refused ``(p, m, v)`` (with the reason)
    and the generated schedules that failed validation (a bug, with the error)."""
    from ..analysis.schedule_check import validate

    done: list[tuple[Schedule, SimResult]] = []
    skipped: dict[str, str] = {}
    broken: dict[str, str] = {}
    for name in registry.names():
        info = registry.get(name)
        try:
            schedule = generate_schedule(name, p, m, v, costs)
        except ScheduleError as exc:
            skipped[info.name] = str(exc)
            continue
        try:
            lowered = validate(schedule)
        except ScheduleError as exc:
            broken[info.name] = str(exc)
            continue
        done.append((schedule, simulated(schedule, costs, lowered)))
    return done, skipped, broken


def iteration_time_1f1b_units(schedule: Schedule, result: SimResult, costs: Costs | None) -> float:
    """The iteration makespan with each op's compute cost divided by the stages a rank holds per
    replica (a V or looped stage is 1/v of a 1F1B stage; a hop still carries a whole activation),
    so schedules with different v compare; ``--costs`` are read as one 1F1B stage's op times."""
    from dataclasses import replace

    from ..schedules.costs import Costs

    k = schedule.placement.stages_per_rank_per_replica
    if k == 1:
        return result.makespan
    base = costs or Costs.unit()

    def scale(x: Any) -> Any:
        return None if x is None else (tuple(v / k for v in x) if isinstance(x, tuple) else x / k)

    scaled = replace(base, t_f=scale(base.t_f), t_b=scale(base.t_b), t_w=scale(base.t_w), t_bw=scale(base.t_bw))
    return simulated(schedule, scaled).makespan


def cmd_compare(args: argparse.Namespace) -> int:
    from ..schedules.limits import MAX_OPS, OPS_PER_PAIR

    count = len(registry.names())  # every schedule is built: the op limit holds for all of them together
    ops = OPS_PER_PAIR * args.p * args.m * (args.v or 2) * count
    if ops > MAX_OPS:
        raise CliError(
            f"compare builds all {count} schedules at -p {args.p} -m {args.m} (v={args.v or 2}): about {ops:,} ops; "
            f"the limit is {MAX_OPS:,} (as for one schedule in simulate): give a smaller -p or -m"
        )
    costs = parse_cli_costs(args.costs)
    done, skipped, broken = compare_rows(args.p, args.m, args.v, costs)
    if args.json:
        payload: dict[str, Any] = {
            "p": args.p,
            "m": args.m,
            "v": args.v,
            "costs": args.costs,
            "schedules": [result.to_json_dict() for _, result in done],
            "inapplicable": skipped,
            "invalid": broken,
        }
        print(json.dumps(payload))
        return 0
    rows = []
    times = [iteration_time_1f1b_units(schedule, result, costs) for schedule, result in done]
    fastest = min(times, default=None)
    for (schedule, result), time in zip(done, times, strict=True):
        worst = max(range(schedule.num_ranks), key=lambda r: result.peak_activations[r])
        rows.append(
            [
                schedule.name,
                schedule.chunks_per_rank,
                num(time) + (" *" if time == fastest else ""),
                f"{result.bubble_rate:.4f}",
                f"{result.sync_bubble_rate:.4f}",
                num(result.peak_activations[worst]),
                num(result.peak_activations_1f1b_units[worst]),
                result.p2p_messages,
            ]
        )
    header = ["schedule", "v", "time", "bubble", "sync bubble", "peak act (stage)", "peak act (1F1B)", "p2p msgs"]
    print(f"p={args.p} m={args.m} v={args.v if args.v is not None else 'default'} costs={args.costs or 'unit'}")
    print("time: iteration makespan (every rank done), costs read as one 1F1B stage's (a stage of a rank holding")
    print("      k stages per model replica costs 1/k of them; a hop costs the same), * = fastest")
    print("peak activations: worst rank, in the schedule's own stage units and in 1F1B stage units")
    print(fmt_table(header, rows))
    if skipped:
        print("\nnot applicable:")
        for name, reason in skipped.items():
            print(f"  {name}: {reason}")
    if broken:
        print("\nINVALID (generated but rejected by validate; a bug, please report):")
        for name, reason in broken.items():
            print(f"  {name}: {reason.splitlines()[0]}")
    return 0


def add_parser(subparsers: Any) -> None:
    """Adds ``compare`` to ``megatron-pp``'s sub-commands (its parser, with ``func`` set)."""
    cmp_ = subparsers.add_parser("compare", help="every applicable schedule side by side")
    cmp_.add_argument("-p", type=argtypes.positive_int, required=True, help="pipeline-parallel size (ranks)")
    cmp_.add_argument("-m", type=argtypes.positive_int, required=True, help="micro-batches per iteration")
    cmp_.add_argument("-v", type=argtypes.positive_int, default=None, help="virtual stages (chunks) per rank")
    cmp_.add_argument("--costs", metavar="F,B,W,COMM", help="per-stage op times and per-hop comm time")
    cmp_.add_argument("--json", action="store_true", help="print the comparison as JSON")
    cmp_.set_defaults(func=cmd_compare)
