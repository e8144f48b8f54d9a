"""Data parallelism inside the schedule, on real gloo ranks: a markdown table for RESULTS.md.

For each configuration: `verify` against the unpartitioned reference (3 Adam steps), the largest
relative gradient difference, the derived collectives each pipeline rank launched in the last
iteration (how many reductions overlapped the rank's remaining backward work) and, under FSDP,
the parameter all-gathers per iteration measured vs derived and the peak bytes held.

    python benchmarks/bench_data_parallel_runs.py [--p4]    (--p4 adds p=4 x dp=2 runs: 8 ranks)
"""

from __future__ import annotations

import argparse

from megatron_pp_ext.schedules import generate
from megatron_pp_ext.verification.rank_run import TrainingRankPool
from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec
from megatron_pp_ext.verification.verify import verify_schedule

CONFIGS = [  # (schedule, p, m, v, mode)
    ("1f1b", 2, 4, None, "ddp"),
    ("interleaved-1f1b", 2, 4, 2, "ddp"),
    ("bfs", 2, 4, 2, "ddp"),
    ("bfs", 2, 4, 2, "distributed-optimizer"),
    ("bfs-zb", 2, 4, 2, "distributed-optimizer"),
    ("interleaved-1f1b", 2, 4, 2, "fsdp"),
    ("bfs", 2, 4, 2, "fsdp"),
]
P4 = [("bfs", 4, 8, 2, "ddp"), ("interleaved-1f1b", 4, 8, 2, "fsdp"), ("bfs", 4, 8, 2, "fsdp")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--p4", action="store_true", help="also p=4 x dp=2 (8 ranks)")
    args = parser.parse_args()
    configs = CONFIGS + (P4 if args.p4 else [])
    print(
        "| schedule | p x dp | v | data parallel | ok | max rel grad diff | reductions overlapping backward "
        "| FSDP gathers / iteration (measured = derived) | FSDP peak full params (bytes) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    with TrainingRankPool(8 if args.p4 else 4) as pool:
        for name, p, m, v, mode in configs:
            schedule = generate(name, p, m, **({"v": v} if v else {}))
            fsdp = mode == "fsdp"
            model = TinyGPTSpec(num_layers=2 * p * (v or 1), tied_embeddings=not fsdp)
            report = verify_schedule(
                schedule, pool, model=model, dp=2, distributed_optimizer=mode == "distributed-optimizer", fsdp=fsdp
            )
            overlapping = [sum("reduce-grads" in x and "overlaps" in x for x in r) for r in report.collectives]
            gathers = (
                "/".join(f"{info['all_gathers_per_iteration'][-1]}={info['derived_unshards']}" for info in report.fsdp)
                if fsdp
                else ""
            )
            peak = "/".join(str(info["peak_bytes"]["full_params"]) for info in report.fsdp) if fsdp else ""
            print(
                f"| `{name}` | {p} x 2 | {v or 1} | {mode} | {'yes' if report.ok else 'NO'} | "
                f"{report.max_rel_grad_diff:.2g} | {overlapping} | {gathers} | {peak} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
