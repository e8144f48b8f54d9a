"""Time per iteration of megatron's training loop (scripts/pretrain_gpt.py, gloo, CPU) with a synchronous
optimizer step, with late post-validation (default of --pipeline-post-validation) and with early
post-validation, run one after the other by this script on the same machine.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/bench_post_validation_pretrain.py -p 2 --iters 12 --clip 1.0

Per run: megatron's logged "elapsed time per iteration (ms)" (averaged by megatron over each --log-interval;
training_log synchronises every rank at each log interval), median over the logged intervals after
iteration 2, and the post-validation summary (rollbacks, re-runs). Tiny model on a shared CPU: the figures are
noisy (other processes share the cores); they show what post-validation costs or saves here, not on GPUs.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "pretrain_gpt.py"
ELAPSED = re.compile(r"iteration\s+(\d+)/\s*\d+ .*elapsed time per iteration \(ms\): ([0-9.]+)")
SUMMARY = re.compile(r"post-validation, pipeline stage (\d+): (.*?snapshot \d+ bytes)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(
    p: int, iters: int, schedule: str, clip: float, log_interval: int, extra: list[str]
) -> tuple[list[float], list[str]]:
    flags = [
        "--cpu", "--pipeline-schedule", schedule, "--pipeline-model-parallel-size", str(p),
        "--num-layers", str(2 * p), "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64",
        "--micro-batch-size", "2", "--global-batch-size", str(8 * p),
        "--train-iters", str(iters), "--lr", "1e-3", "--clip-grad", str(clip),
        "--eval-iters", "0", "--log-interval", str(log_interval), "--num-workers", "0",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(p), "--master-port", str(free_port())]
    out = subprocess.run([*cmd, str(SCRIPT), *flags, *extra], env=env, capture_output=True, text=True, timeout=900)
    text = out.stdout + out.stderr
    if out.returncode != 0:
        raise SystemExit(f"run failed ({' '.join(extra) or 'synchronous'}):\n{text[-3000:]}")
    times = [float(ms) for it, ms in ELAPSED.findall(text) if int(it) > 2]
    return times, [f"stage {s}: {rest}" for s, rest in sorted(SUMMARY.findall(text))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-p", type=int, default=2, help="pipeline ranks (processes)")
    parser.add_argument("--iters", type=int, default=12)
    parser.add_argument("--schedule", default="zb-h1")
    parser.add_argument("--clip", type=float, default=1.0, help="--clip-grad (0: off)")
    parser.add_argument("--log-interval", type=int, default=1)
    args = parser.parse_args()
    runs = {
        "synchronous": [],
        "post-validation (late)": ["--pipeline-post-validation"],
        "post-validation (early)": ["--pipeline-post-validation", "--pipeline-post-validation-early"],
    }
    medians = {}
    print(
        f"{args.schedule}, p={args.p}, m={4 * args.p}, {args.iters} iterations, clip {args.clip}, "
        f"log interval {args.log_interval}"
    )
    print("| run | median ms/iteration (logged after iteration 2) | ratio to synchronous | post-validation |")
    print("| --- | --- | --- | --- |")
    for name, extra in runs.items():
        times, summary = run(args.p, args.iters, args.schedule, args.clip, args.log_interval, extra)
        medians[name] = statistics.median(times)
        ratio = medians[name] / medians["synchronous"]
        print(f"| {name} | {medians[name]:.1f} | {ratio:.3f} | {'; '.join(summary) or '-'} |", flush=True)


if __name__ == "__main__":
    main()
