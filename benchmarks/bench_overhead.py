"""Executor overhead: our ``1f1b`` against megatron-core's own 1F1B on the same CPU ranks.

Two gloo ranks (one per core), one model, the same data and op order. Every
iteration runs megatron's ``forward_backward_func`` and ours back to back on the
same ranks, alternating which goes first, so machine drift hits both alike. Per
iteration the slowest rank's time counts; warm-up iterations are dropped; the
figure is the median over iterations of ours / megatron's.

    python benchmarks/bench_overhead.py [--iterations 30] [-m 8]
"""

from __future__ import annotations

import argparse
import statistics

from megatron_pp_ext.schedules import generate
from megatron_pp_ext.verification.rank_pool import check_errors
from megatron_pp_ext.verification.rank_run import TrainingRankPool
from megatron_pp_ext.verification.run_spec import AB, NATIVE, OURS, RunSpec
from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("-m", type=int, default=8)
    args = parser.parse_args()
    p = 2
    model = TinyGPTSpec(
        num_layers=4, hidden_size=256, num_attention_heads=8, seq_length=128, vocab_size=1024, micro_batch_size=4
    )
    spec = RunSpec(
        pp=p,
        num_microbatches=args.m,
        schedule_csv=generate("1f1b", p, args.m).to_csv(),
        model=model,
        iterations=args.iterations,
        mode=AB,
        timeout_s=300.0,
    )
    with TrainingRankPool(p) as pool:
        results = pool.run(spec, wall_timeout_s=3600)
    check_errors(results)
    assert all(r["losses"][NATIVE] == r["losses"][OURS] for r in results), "same math expected"
    native = [max(r["step_times"][NATIVE][i] for r in results) for i in range(args.iterations)][args.warmup :]
    ours = [max(r["step_times"][OURS][i] for r in results) for i in range(args.iterations)][args.warmup :]
    ratios = [b / a for a, b in zip(native, ours, strict=True)]
    print("| measure | megatron 1F1B | megatron_pp_ext 1f1b | ours / megatron |")
    print("| --- | --- | --- | --- |")
    print(
        f"| median s/iteration | {statistics.median(native):.4f} | {statistics.median(ours):.4f} | "
        f"{statistics.median(ours) / statistics.median(native):.4f} |"
    )
    print(f"| median of per-iteration ratios | | | {statistics.median(ratios):.4f} |")
    print(
        f"\n{len(ratios)} iterations after {args.warmup} warm-up; p={p}, m={args.m}, hidden 256, 4 layers, "
        "seq 128, micro-batch 4, fp32, one thread per rank; losses identical in every iteration."
    )


if __name__ == "__main__":
    main()
