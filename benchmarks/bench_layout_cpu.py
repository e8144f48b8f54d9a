"""A planned layer layout on real ranks: a tiny GPT whose output layer dominates (hidden 64, vocabulary
32768, 4 layers) on 2 CPU pipeline ranks (gloo, megatron's own training loop through
scripts/pretrain_gpt.py), under 1f1b and zb-h1, with the uniform split (``Ett|ttL``) and with the layout
the planner chooses (``--layer-split search``), each passed as ``--pipeline-model-parallel-layout``.

Prints, per schedule and layout, the measured iteration time (median of the iterations after the first
``WARMUP``) and the planner's prediction (the ``CPU`` device preset, a rough model of this machine), and
the planned / uniform ratios of both. One run at a time.

    PYTHONPATH=. python benchmarks/bench_layout_cpu.py [--iters 24] [--rounds 1]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_pp_ext.planner.cost_model import CostModel, get_device  # noqa: E402
from megatron_pp_ext.planner.memory import TrainingSetup  # noqa: E402
from megatron_pp_ext.planner.models import ModelSpec  # noqa: E402
from megatron_pp_ext.planner.search import Planner  # noqa: E402
from megatron_pp_ext.planner.space import SearchSpace  # noqa: E402

WARMUP = 4
SCHEDULES = ("1f1b", "zb-h1")
UNIFORM = "Ett|ttL"
MODEL = ModelSpec("tiny-big-vocab", 4, 64, 4, 64, vocab_size=32768)
RUN_ARGS = [
    "--cpu",
    "--pipeline-model-parallel-size", "2",
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "2", "--global-batch-size", "16",
    "--lr", "3e-3", "--lr-decay-style", "constant", "--eval-iters", "0", "--log-interval", "1", "--num-workers", "0",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", str(MODEL.vocab_size),
]  # fmt: skip
ITERATION = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")


def planner(layout: str | None) -> Planner:
    cost = CostModel(MODEL, get_device("CPU"), TrainingSetup(precision="fp32", attention="unfused"))
    space = SearchSpace(
        tp=(1,), pp=(2,), micro_batch=(2,), recompute=("none",), schedules=SCHEDULES, virtual=(1,),
        layer_split="search", layout=layout,
    )  # fmt: skip
    return Planner(MODEL, 2, 16, cost, space=space)


def predictions() -> dict[tuple[str, str], float]:
    """Predicted iteration seconds per (schedule, layout): the uniform split and the planner's layout."""
    out: dict[tuple[str, str], float] = {}
    for row in planner(None).run(progress=False).rows:
        out.setdefault((row.config.schedule, row.config.layout or UNIFORM), row.iteration_time)
    return out


def measure(schedule: str, layout: str, iters: int, port: int) -> float:
    """Median milliseconds per iteration of one run (after the warm-up iterations)."""
    text = layout.replace("t*4", "tttt")  # written out, as the plan's flags are
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port)]
    cmd += [str(REPO / "scripts" / "pretrain_gpt.py"), "--pipeline-schedule", schedule, *RUN_ARGS]
    cmd += ["--train-iters", str(iters), "--pipeline-model-parallel-layout", text]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, check=False)
    times = [float(x) for x in ITERATION.findall(done.stdout + done.stderr)]
    if done.returncode != 0 or len(times) <= WARMUP:
        raise SystemExit(f"{schedule} {layout}: run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return statistics.median(times[WARMUP:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=1, help="runs per configuration, interleaved")
    args = parser.parse_args()
    predicted = predictions()
    measured: dict[tuple[str, str], list[float]] = {}
    port = 29650
    for _ in range(args.rounds):
        for key in sorted(predicted):
            port += 1
            measured.setdefault(key, []).append(measure(*key, args.iters, port))
    print("| schedule | layout | measured ms / iteration (median) | predicted ms (CPU preset) |")
    print("| --- | --- | --- | --- |")
    for (schedule, layout), seconds in sorted(predicted.items()):
        ms = statistics.median(measured[(schedule, layout)])
        cell = layout.replace("|", "\\|")  # a table cell
        print(f"| {schedule} | `{cell}` | {ms:.0f} | {1e3 * seconds:.0f} |")
    print("\n| schedule | planned layout | measured planned / uniform | predicted planned / uniform |")
    print("| --- | --- | --- | --- |")
    for schedule in SCHEDULES:
        planned = [k for k in predicted if k[0] == schedule and k[1] != UNIFORM]
        for key in planned:
            m_ratio = statistics.median(measured[key]) / statistics.median(measured[(schedule, UNIFORM)])
            p_ratio = predicted[key] / predicted[(schedule, UNIFORM)]
            cell = key[1].replace("|", "\\|")
            print(f"| {schedule} | `{cell}` | {m_ratio:.2f} | {p_ratio:.2f} |")


if __name__ == "__main__":
    main()
