"""Planned configurations run on this machine (CPU, gloo): what ``megatron-pp launch-local`` does.

The same path as a cluster grid, without a cluster: plan (by default the ``tiny`` model on 2
CPU "GPUs", pipeline size 2, the ``CPU`` device preset), pick configurations, run each with
``python -m torch.distributed.run --nproc-per-node N scripts/pretrain_gpt.py --cpu ...`` (the
driver switches megatron to CPU / gloo) for a few iterations, writing ``OUT/logs/<config id>.log``
in the format ``collect`` reads, and ``OUT/plan.json``. ``--collect`` then writes
``OUT/logs/results.{csv,md}`` and ``throughput.png``.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .children import run_child
from .grid import DEFAULT_SCRIPT, common_args

__all__ = ["run_local"]


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
