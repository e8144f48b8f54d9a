"""What planning the layer layout gains: per preset and schedule family, the best configuration of one
search with the layout axis (``megatron-pp plan --layer-split search``) against the best configuration of
the same search whose layers are split uniformly (even, or the first and last stage one layer short).

Both come from one search with the same per-layer cost model (embedding and output layer + loss
included), so the gain is the layout's alone, with every other axis (TP, PP, DP, micro-batch, chunks,
recompute) re-chosen jointly. Predictions only (the simulator and the memory model), no run.

    PYTHONPATH=. python benchmarks/bench_layout_plan.py [--case NAME ...] [--micro-batch 1,2]

Cases: ``llama3-70b`` on 64 H100s and on 64 A100s at the Llama 3 paper's 4M-token batch (512 x 8192)
and at a quarter of it, ``llama3-8b`` on 8 H100s, ``deepseek-v2-lite`` on 16 H100s, ``nemotron-h-8b`` on
8 H100s (cluster sizes and batches of the last three assumed).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_pp_ext.planner.cost_model import CostModel, get_device
from megatron_pp_ext.planner.memory import TrainingSetup
from megatron_pp_ext.planner.models import get_model
from megatron_pp_ext.planner.result import PlanRow
from megatron_pp_ext.planner.search import Planner
from megatron_pp_ext.planner.space import SearchSpace

FAMILIES = ("1f1b", "zb-h1", "interleaved-1f1b", "v-zb", "dualpipev")
CASES = {  # name: (preset, device, GPUs, global batch)
    "llama3-70b-h100": ("llama3-70b", "H100-80GB", 64, 512),
    "llama3-70b-h100-b128": ("llama3-70b", "H100-80GB", 64, 128),
    "llama3-70b-a100": ("llama3-70b", "A100-80GB", 64, 512),
    "llama3-8b-h100": ("llama3-8b", "H100-80GB", 8, 128),
    "deepseek-v2-lite-h100": ("deepseek-v2-lite", "H100-80GB", 16, 256),
    "nemotron-h-8b-h100": ("nemotron-h-8b", "H100-80GB", 8, 128),
}


def describe(row: PlanRow | None) -> str:
    if row is None:
        return "none fits"
    c = row.config
    return f"t{c.tp} p{c.pp} d{c.dp} b{c.micro_batch} v{c.chunks} {c.recompute}: {row.iteration_time:.3f} s"


def best(rows: list[PlanRow], schedule: str | None, planned: bool | None) -> PlanRow | None:
    """The fastest row of ``schedule`` (None: any); ``planned``: only planned / only uniform layouts."""
    picked = [
        r
        for r in rows
        if (schedule is None or r.config.schedule == schedule)
        and (planned is None or (r.config.layout is not None) == planned)
    ]
    return min(picked, key=lambda r: r.iteration_time, default=None)


def gain(uniform: PlanRow | None, joint: PlanRow | None) -> str:
    if uniform is None or joint is None:
        return "-"
    return f"{100 * (1 - joint.iteration_time / uniform.iteration_time):.1f}%"


def run_case(name: str, micro_batches: tuple[int, ...] | None) -> None:
    preset, device, gpus, batch = CASES[name]
    model = get_model(preset)
    cost = CostModel(model, get_device(device), TrainingSetup(distributed_optimizer=True))
    space = SearchSpace(schedules=FAMILIES, layer_split="search", micro_batch=micro_batches, virtual=(1, 2, 4))
    started = time.process_time()
    result = Planner(model, gpus, batch, cost, space=space).run(progress=False)
    cpu = time.process_time() - started
    print(f"\n### {preset} on {gpus} x {device}, global batch {batch} ({model.seq_length} tokens each)\n")
    print(
        f"{result.evaluated} candidates, {len(result.rows)} rows fit, {result.stats.get('layouts simulated', 0)} "
        f"layouts simulated, {cpu:.0f} s CPU\n"
    )
    print("| schedule | best uniform layout | best with the layout planned | its layout | gain |")
    print("| --- | --- | --- | --- | --- |")
    for schedule in (*FAMILIES, None):
        uniform, joint = best(result.rows, schedule, False), best(result.rows, schedule, None)
        layout = joint.config.layout if joint is not None and joint.config.layout else "(uniform)"
        layout = layout.replace("|", "\\|")  # a table cell
        label = schedule or "**any (joint)**"
        print(f"| {label} | {describe(uniform)} | {describe(joint)} | `{layout}` | {gain(uniform, joint)} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", nargs="*", choices=sorted(CASES), help="default: every case")
    parser.add_argument("--micro-batch", help="micro-batch sizes to search (default: the planner's)")
    args = parser.parse_args()
    micro = tuple(int(x) for x in args.micro_batch.split(",")) if args.micro_batch else None
    for name in args.case or list(CASES):
        run_case(name, micro)


if __name__ == "__main__":
    main()
