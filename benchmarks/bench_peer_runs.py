"""Real CPU runs: megatron-core's own 1F1B and interleaved 1F1B vs ours, same tiny GPT, same data (issue 20).

Every iteration runs megatron's ``forward_backward_func`` and ours back to back on the same gloo ranks,
model and data, alternating which goes first (runtime/verify.py mode AB). Reported per case: the median
over iterations of ours / megatron's wall time (slowest rank per iteration, warm-up dropped), the peak
bytes autograd holds for backward per rank (parameters excluded; one extra iteration of each under
``SavedBytesMeter``), and whether every micro-batch loss is equal (bitwise) in every iteration.

    python benchmarks/bench_peer_runs.py [--iterations 12] [--warmup 2]
"""

from __future__ import annotations

import argparse
import statistics

from megatron_pp_ext.runtime.tiny_gpt import TinyGPTSpec
from megatron_pp_ext.runtime.verify import AB, NATIVE, OURS, RankPool, RunSpec, _check_errors
from megatron_pp_ext.schedules import generate

# (our schedule, megatron's, p, m, v). Interleaving at p=2 is left out: megatron-core's batched p2p
# swaps the activation and the gradient exchanged with the single peer (DESIGN.md, known trap).
CASES = [("1f1b", "1F1B", 2, 8, 1), ("1f1b", "1F1B", 4, 8, 1), ("interleaved-1f1b", "interleaved 1F1B", 4, 8, 2)]
MODEL = TinyGPTSpec(
    num_layers=8, hidden_size=128, num_attention_heads=4, seq_length=64, vocab_size=512, micro_batch_size=2
)


def kib(x: float) -> str:
    return f"{x / 1024:.0f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    print(
        "| ours | megatron-core | p | m | v | ours / megatron wall time (median) | losses equal "
        "| peak saved KiB per rank, megatron | ours |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    with RankPool(max(c[2] for c in CASES)) as pool:
        for name, theirs, p, m, v in CASES:
            schedule = generate(name, p, m, v=v if v > 1 else None)
            spec = RunSpec(
                pp=p,
                num_microbatches=m,
                schedule_csv=schedule.to_csv(),
                model=MODEL,
                iterations=args.iterations,
                mode=AB,
                timeout_s=300.0,
            )
            results = sorted(pool.run(spec, wall_timeout_s=3600), key=lambda r: r.get("pp_rank", 0))
            _check_errors(results)
            n = args.iterations
            native = [max(r["step_times"][NATIVE][i] for r in results) for i in range(n)][args.warmup :]
            ours = [max(r["step_times"][OURS][i] for r in results) for i in range(n)][args.warmup :]
            ratio = statistics.median(b / a for a, b in zip(native, ours, strict=True))
            equal = all(r["losses"][NATIVE] == r["losses"][OURS] for r in results)
            peak_n = " / ".join(kib(r["peak_saved_bytes"][NATIVE]) for r in results)
            peak_o = " / ".join(kib(r["peak_saved_bytes"][OURS]) for r in results)
            print(
                f"| {name} | {theirs} | {p} | {m} | {v} | {ratio:.3f} | {'yes' if equal else 'NO'} "
                f"| {peak_n} | {peak_o} |",
                flush=True,
            )
    print(
        f"\n{args.iterations - args.warmup} iterations after {args.warmup} warm-up; "
        f"tiny GPT: {MODEL.num_layers} layers, hidden {MODEL.hidden_size}, seq {MODEL.seq_length}, "
        f"micro-batch {MODEL.micro_batch_size}, fp32, one thread per rank, gloo on a 2-core machine "
        "(p=4 runs 2 ranks per core)."
    )


if __name__ == "__main__":
    main()
