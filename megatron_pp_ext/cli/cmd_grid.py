"""``megatron-pp grid --slurm``: a Slurm job array (``job.sbatch``, ``configs.tsv``, ``plan.json``) running
planned configurations, from a plan, from the plan flags or from a checked-in specification."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path
from typing import Any

from ..argtypes import output_dir
from ..planner.driver_flags import driver_flags, unknown_flags
from ..planner.grid import DEFAULT_SCRIPT, relative_path, write_grid
from ..planner.options import add_plan_arguments
from ..planner.sbatch import GridOptions, default_driver
from .cmd_plan import add_top_argument
from .planned import load_or_plan


def add_parser(subparsers: Any) -> None:
    """Adds ``grid`` to ``megatron-pp``'s sub-commands (its parser, with ``func`` set)."""
    p = subparsers.add_parser(
        "grid",
        help="write a Slurm job array (sbatch + config table) running planned configurations",
        description="Select configurations from a plan (--plan FILE, or plan now with the plan flags) and "
        "write DIR/job.sbatch, DIR/configs.tsv and DIR/plan.json; submit with `sbatch DIR/job.sbatch`.",
    )
    p.add_argument("--slurm", action="store_true", help="write a Slurm job array (the only backend)")
    p.add_argument("--out", type=output_dir, metavar="DIR", help="directory for job.sbatch, configs.tsv, plan.json")
    p.add_argument("--plan", metavar="PLAN.json", help="a plan written by `megatron-pp plan --save`")
    p.add_argument(
        "--spec",
        metavar="SPEC.json",
        help="a checked-in plan specification (scripts/slurm/specs/*.json): plan it and write its script "
        "into its 'out' directory (relative to the current directory, the submission directory)",
    )
    sel = p.add_argument_group("selection")
    sel.add_argument("--best-per-schedule", action="store_true", help="each schedule's best configuration")
    add_top_argument(sel, 8)
    sl = p.add_argument_group("slurm")
    sl.add_argument("--nodes", type=int, help="nodes per configuration (default: GPUs / GPUs per node)")
    sl.add_argument("--partition")
    sl.add_argument("--account")
    sl.add_argument("--qos")
    sl.add_argument("--time", default="00:30:00", help="time limit per configuration (default 00:30:00)")
    sl.add_argument("--cpus-per-task", type=int)
    sl.add_argument("--container", help="container image (pyxis: srun --container-image)")
    sl.add_argument("--container-mounts", help="srun --container-mounts value")
    sl.add_argument("--venv", help="virtualenv / conda prefix to activate (PREFIX/bin/activate)")
    sl.add_argument("--setup", action="append", default=[], help="shell line run before srun (repeatable)")
    sl.add_argument("--log-dir", help="where each configuration's log goes (default: OUT/logs)")
    sl.add_argument("--train-iters", type=int, default=20, help="iterations per configuration (default 20)")
    sl.add_argument("--max-parallel", type=int, help="at most this many array tasks at once")
    sl.add_argument(
        "--script",
        help="path of the training driver on the cluster (default: $MPP_REPO/scripts/pretrain_gpt.py, "
        "pretrain_hybrid.py for a hybrid model)",
    )
    sl.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra environment (repeatable)")
    sl.add_argument("--extra-args", default="", help="more pretrain_gpt.py flags for every configuration")
    sl.add_argument("--check", action="store_true", help="check every flag against pretrain_gpt.py (slow, ~20 s)")
    add_plan_arguments(p)
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    p.set_defaults(func=cmd_grid)


def cmd_grid(args: argparse.Namespace) -> int:
    if not args.slurm:
        raise ValueError("give --slurm (the only launcher backend); for this machine use `megatron-pp launch-local`")
    if args.spec:
        from ..planner.specs import load_spec, write_spec_grid

        spec = load_spec(args.spec)
        paths = write_spec_grid(spec, Path.cwd(), args.out)
        sbatch = relative_path(paths["sbatch"].resolve(), Path.cwd())
        print(f"wrote {sbatch} (+ configs.tsv, plan.json); submit from here")
        return 0
    if not args.out:
        raise ValueError("give --out DIR (or --spec SPEC.json)")
    env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--env expects KEY=VALUE, got {item!r}")
        env[key] = value
    doc, rows = load_or_plan(args)
    opts = GridOptions(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node or int(doc.get("gpus_per_node") or 8),
        partition=args.partition,
        account=args.account,
        qos=args.qos,
        time=args.time,
        cpus_per_task=args.cpus_per_task,
        container=args.container,
        container_mounts=args.container_mounts,
        venv=args.venv,
        setup=list(args.setup),
        log_dir=args.log_dir,
        train_iters=args.train_iters,
        max_parallel=args.max_parallel,
        script=args.script,
        extra_args=shlex.split(args.extra_args),
        env=env,
    )
    paths = write_grid(args.out, doc, rows, opts)
    here = Path.cwd()
    sbatch, logs = (relative_path(paths[k].resolve(), here) for k in ("sbatch", "log_dir"))
    print(f"wrote {sbatch} ({len(rows)} array tasks), configs.tsv and plan.json next to it")
    print(f"submit from {here} (the script's paths are relative to it): sbatch {sbatch}")
    print(f"logs go to {logs}; then: megatron-pp collect {logs}")
    if args.check:
        script = args.script or DEFAULT_SCRIPT.with_name(default_driver(doc))  # the driver the job script runs
        known, how = driver_flags(script)
        bad = unknown_flags(args.out, known)
        if bad:
            print(f"UNKNOWN flags (not accepted by {script}, via {how}): {', '.join(bad)}", file=sys.stderr)
            return 1
        print(f"every flag is accepted by {Path(script).name} (checked via {how})")
    return 0
