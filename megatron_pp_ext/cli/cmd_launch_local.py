"""``megatron-pp launch-local``: run planned configurations on this machine (CPU / gloo, the tiny model by
default) and collect their logs."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from ..argtypes import output_dir, positive_float, positive_int
from ..planner.collect import collect
from ..planner.collect_report import to_markdown, write_outputs
from ..planner.grid import DEFAULT_SCRIPT
from ..planner.local import run_local
from ..planner.log_parse import parse_log
from ..planner.options import add_plan_arguments
from .cmd_plan import add_top_argument
from .planned import load_or_plan


def add_parser(subparsers: Any) -> None:
    """Adds ``launch-local`` to ``megatron-pp``'s sub-commands (its parser, with ``func`` set)."""
    p = subparsers.add_parser(
        "launch-local",
        help="run planned configurations on this machine (CPU / gloo, tiny model) and collect their logs",
        description="Plan (default: --model tiny --device CPU --gpus 2 --pp 2), then run the selected "
        "configurations with torchrun + scripts/pretrain_gpt.py --cpu for a few iterations each.",
    )
    p.add_argument("--out", required=True, type=output_dir, metavar="DIR", help="directory for plan.json and logs/")
    p.add_argument("--plan", metavar="PLAN.json", help="use this plan instead of planning now")
    p.add_argument("--best-per-schedule", action="store_true", help="each schedule's best configuration")
    add_top_argument(p, 2)
    p.add_argument("--train-iters", type=positive_int, default=4, help="iterations per run (default 4)")
    p.add_argument("--nproc", type=positive_int, help="processes per run (default: the plan's GPU count)")
    p.add_argument("--script", default=str(DEFAULT_SCRIPT))
    p.add_argument("--master-port", type=int, default=29650)
    p.add_argument("--timeout", type=positive_float, default=900.0, help="seconds per run before it is killed")
    p.add_argument("--extra-args", default="", help="more pretrain_gpt.py flags for every run")
    p.add_argument("--collect", action="store_true", help="collect the logs into results.* afterwards")
    p.add_argument("--dry-run", action="store_true", help="only print what would run")
    add_plan_arguments(p)
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=False)
    p.set_defaults(func=cmd_launch_local)


def cmd_launch_local(args: argparse.Namespace) -> int:
    if not args.plan:
        if not args.model and args.num_layers is None:
            args.model = "tiny"
        if args.device == "A100-80GB":  # the shared default: this launcher runs on CPU
            args.device = "CPU"
        if args.pp is None and args.model == "tiny":
            args.pp = (2,)
        if args.micro_batch is None and args.model == "tiny":
            args.micro_batch = (2,)  # m = 4 micro-batches: at m = 1 a pipeline has nothing to overlap
    doc, rows = load_or_plan(args)
    if not rows:
        raise ValueError("the plan has no configuration that fits")
    if args.dry_run:
        for row in rows:
            print(row["id"], " ".join(row["megatron_args"]))
        return 0
    results = run_local(
        args.out,
        doc,
        rows,
        train_iters=args.train_iters,
        nproc=args.nproc,
        script=args.script,
        master_port=args.master_port,
        timeout=args.timeout,
        extra_args=shlex.split(args.extra_args),
    )
    failed = []
    for cid, code, log in results:
        if code != 0:
            if parse_log(log).status != "exit-error":
                failed.append(cid)
            else:
                print(f"{cid}: trained every iteration but exited with code {code}", file=sys.stderr)
    if args.collect:
        logs = Path(args.out) / "logs"
        table, _ = collect(logs, Path(args.out) / "plan.json")
        paths = write_outputs(table, logs)
        print(to_markdown(table))
        print(f"wrote {', '.join(str(p) for p in paths.values())}")
    if failed:
        print(f"{len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
