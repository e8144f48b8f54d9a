"""``megatron-pp validate``: check a schedule file (dependencies, placement, deadlock freedom, collectives)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..schedule_args import CliError
from ..schedules.ir import ScheduleError
from ..schedules.schedule import Schedule
from .support import EXIT_INVALID


def cmd_validate(args: argparse.Namespace) -> int:
    from ..analysis.schedule_check import check_collective_plan, validate
    from ..schedules.collectives import CollectiveKind, policy_for

    wants = args.collectives or args.fsdp or args.distributed_optimizer or args.fsdp_max_unsharded is not None
    if args.fsdp_max_unsharded is not None and (not args.fsdp or args.fsdp_max_unsharded < 1):
        raise CliError(f"--fsdp-max-unsharded needs --fsdp and must be >= 1, got {args.fsdp_max_unsharded}")
    collectives = ""
    try:
        schedule = Schedule.load(args.file)
        lowered = validate(schedule)
        if wants:
            policy = policy_for(
                schedule,
                fsdp=args.fsdp,
                distributed_optimizer=args.distributed_optimizer,
                fsdp_max_unsharded=args.fsdp_max_unsharded,
            )
            plan = check_collective_plan(schedule, policy)
            counts = ", ".join(f"{plan.count(kind)} {kind}" for kind in CollectiveKind if plan.count(kind))
            collectives = f"; collectives checked ({counts or 'none'})"
    except ScheduleError as exc:
        message = str(exc)
        prefix = f"{args.file}:"
        print(f"INVALID {message if message.startswith(prefix) else f'{prefix} {message}'}", file=sys.stderr)
        return EXIT_INVALID
    num_ops = sum(len(row) for row in schedule.ops)
    print(
        f"OK {args.file}: {schedule.name}, {schedule.placement.style} placement, p={schedule.num_ranks} "
        f"m={schedule.num_microbatches} stages={schedule.num_stages}, {num_ops} ops, "
        f"{len(lowered.messages)} p2p messages, {len(lowered.local_handoffs)} local hand-offs, deadlock-free"
        f"{collectives}"
    )
    return 0


def add_parser(subparsers: Any) -> None:
    """Adds ``validate`` to ``megatron-pp``'s sub-commands (its parser, with ``func`` set)."""
    val = subparsers.add_parser("validate", help="check a schedule CSV (dependencies, placement, deadlock freedom)")
    val.add_argument("file", help="schedule CSV")
    val.add_argument(
        "--collectives", action="store_true", help="also derive and check the data-parallel gradient reductions"
    )
    val.add_argument("--fsdp", action="store_true", help="... and FSDP gathers / reshards (implies --collectives)")
    val.add_argument("--fsdp-max-unsharded", type=int, default=None, metavar="K", help="FSDP chunks gathered at once")
    val.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="... and per-chunk parameter gathers (implies --collectives)",
    )
    val.set_defaults(func=cmd_validate)
