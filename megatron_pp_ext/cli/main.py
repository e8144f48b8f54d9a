"""The ``megatron-pp`` entry point: the top-level parser, one sub-command per module, and the dispatch
(errors become one line on stderr and exit code 2)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..schedule_args import PROG
from ..schedules.ir import ScheduleError
from . import (
    cmd_bench,
    cmd_collect,
    cmd_compare,
    cmd_draw,
    cmd_grid,
    cmd_launch_local,
    cmd_listing,
    cmd_plan,
    cmd_simulate,
    cmd_validate,
    cmd_verify,
)
from .support import EXIT_USAGE

__all__ = ["build_parser", "main"]


def build_parser(load_verify: bool = False) -> argparse.ArgumentParser:
    """All sub-commands, in the order ``--help`` lists them; ``load_verify``: the real ``verify`` parser
    (imports the runtime) instead of its stub."""
    parser = argparse.ArgumentParser(prog=PROG, description="Pipeline-parallel schedules for megatron-core.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in (cmd_listing, cmd_simulate, cmd_compare, cmd_validate, cmd_draw, cmd_bench):
        module.add_parser(sub)
    cmd_verify.add_parser(sub, load_verify)
    for module in (cmd_plan, cmd_grid, cmd_collect, cmd_launch_local):
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(load_verify=cmd_verify.wants_verify(args_list))
    args = parser.parse_args(args_list)
    try:
        return int(args.func(args))
    except (ScheduleError, ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # e.g. `megatron-pp simulate ... | head`: the reader left, not an error
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
