"""``megatron-pp launch-local``: run planned configurations on this machine (CPU, gloo).

The same path as a cluster grid, without a cluster: plan (by default the ``tiny`` model on 2
CPU "GPUs", pipeline size 2, the ``CPU`` device preset), pick configurations, run each with
``python -m torch.distributed.run --nproc-per-node N scripts/pretrain_gpt.py --cpu ...`` (the
driver switches megatron to CPU / gloo) for a few iterations, writing ``OUT/logs/<config id>.log``
in the format ``collect`` reads, and ``OUT/plan.json``. ``--collect`` then writes
``OUT/logs/results.{csv,md}`` and ``throughput.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..argtypes import output_dir, positive_float, positive_int
from .children import run_child
from .slurm import DEFAULT_SCRIPT, common_args

__all__ = ["add_parser", "run_local"]


def run_local(
    out_dir: str | Path,
    plan: Mapping[str, Any],
    rows: Sequence[Mapping[str, Any]],
    *,
    train_iters: int = 4,
    nproc: int | None = None,
    script: str | Path = DEFAULT_SCRIPT,
    python: str = sys.executable,
    master_port: int = 29650,
    timeout: float = 900.0,
    extra_args: Sequence[str] = (),
    echo: bool = True,
) -> list[tuple[str, int, Path]]:
    """Run ``rows`` one after the other; returns ``(config id, exit code, log path)`` per run."""
    out = Path(out_dir).resolve()
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    nproc = nproc or int(plan["gpus"])
    common = [*common_args(plan, train_iters, extra_args), "--num-workers", "0", "--cpu"]
    doc = dict(plan)
    doc["rows"] = list(rows)
    doc["local"] = {"nproc": nproc, "train_iters": train_iters, "common_args": common}
    (out / "plan.json").write_text(json.dumps(doc, indent=1) + "\n")
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    results = []
    for i, row in enumerate(rows):
        cid = str(row["id"])
        log = logs / f"{cid}.log"
        cmd = [
            python,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(nproc),
            "--master-port",
            str(master_port + i),
            str(script),
            *common,
            *row["megatron_args"],
        ]
        if echo:
            print(f"[{i + 1}/{len(rows)}] {cid}: {log}", flush=True)
        start = time.monotonic()
        with log.open("w") as fh:
            fh.write(f"# megatron-pp config {cid} (local run {i + 1} of {len(rows)})\n")
            fh.write(f"# args: {' '.join(common)} {' '.join(row['megatron_args'])}\n")
            fh.write(f"# command: {shlex.join(cmd)}\n")
            fh.flush()
            try:  # its own process group: stopped on a timeout, and with launch-local on SIGTERM / SIGINT
                code, _, _ = run_child(cmd, timeout=timeout, stdout=fh, stderr=subprocess.STDOUT, env=env)
            except subprocess.TimeoutExpired:
                fh.write(f"\n# megatron-pp timeout after {timeout:g} s\n")
                code = -9
        with log.open("a") as fh:
            fh.write(f"# megatron-pp exit code {code}\n")
        if echo:
            print(f"    exit code {code} after {time.monotonic() - start:.0f} s", flush=True)
        results.append((cid, code, log))
    return results


def add_parser(subparsers: Any) -> None:
    from .plan_cli import add_plan_arguments, add_top_argument

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
    from .slurm import load_or_plan

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
            from .collect import parse_log

            if parse_log(log).status != "exit-error":
                failed.append(cid)
            else:
                print(f"{cid}: trained every iteration but exited with code {code}", file=sys.stderr)
    if args.collect:
        from .collect import collect, to_markdown, write_outputs

        logs = Path(args.out) / "logs"
        table, _ = collect(logs, Path(args.out) / "plan.json")
        paths = write_outputs(table, logs)
        print(to_markdown(table))
        print(f"wrote {', '.join(str(p) for p in paths.values())}")
    if failed:
        print(f"{len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
