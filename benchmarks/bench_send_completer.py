"""What the gloo send-completer threads cost: ours against megatron-core's own schedule, with and without them.

On gloo a send cannot be polled, so the executor hands each send to a thread per peer that waits for it
(``runtime/p2p.py`` ``Completer``, docs/p2p.md). With more ranks than cores those threads' wake-ups take turns on
the cores with the ranks' compute. This script runs megatron-core's function and ours on the same ranks (mode
``AB``, alternating iterations, the same tiny GPT as ``megatron-pp bench --real-peers``) once as the runtime
ships and once with ``PerTransfer.watches_sends`` set to False on every rank (sends then complete only at the
protocol's own waits: before the pseudo-free of a sent output, at the send bound, at the end of the iteration),
alternating the two settings, and prints ours / megatron (median and quartiles of the paired iterations).

    python benchmarks/bench_send_completer.py --schedule interleaved-1f1b -p 4 --iterations 82 --repeats 2
"""

from __future__ import annotations

import argparse
import os
import statistics
from typing import Any

from megatron_pp_ext.bench.real_peers_bench import paired
from megatron_pp_ext.bench.real_peers_cases import model_spec, num_microbatches
from megatron_pp_ext.schedules import generate
from megatron_pp_ext.verification import rank_run
from megatron_pp_ext.verification.rank_pool import check_errors
from megatron_pp_ext.verification.run_spec import AB, NATIVE, OURS, RunSpec

WITHOUT = "MEGATRON_PP_BENCH_NO_SEND_COMPLETER"  # read by the ranks: set by this script only


def run_on_rank(spec: RunSpec, rank: int, init_method: str) -> dict[str, Any]:
    """:func:`rank_run.run_on_rank`, with the completer threads switched off when the parent asked for it."""
    if os.environ.get(WITHOUT) == "1":
        from megatron_pp_ext.runtime import p2p

        p2p.PerTransfer.watches_sends = False
    return rank_run.run_on_rank(spec, rank, init_method)


def one_run(spec: RunSpec, warmup: int, without: bool) -> str:
    os.environ[WITHOUT] = "1" if without else "0"  # the pool's ranks are spawned below and inherit it
    with rank_run.TrainingRankPool(spec.world_size) as pool:
        results = pool.run_fn(run_on_rank, spec, spec.world_size, 3600)
    check_errors(results)
    ours = [max(r["step_times"][OURS][i] for r in results) for i in range(spec.iterations)][warmup:]
    native = [max(r["step_times"][NATIVE][i] for r in results) for i in range(spec.iterations)][warmup:]
    ratio, (q1, q3) = paired(ours, native)
    setting = "without the completer threads" if without else "with the completer threads (as shipped)"
    return (
        f"| {spec_name(spec)} | {setting} | {statistics.median(ours) * 1e3:.1f} | "
        f"{statistics.median(native) * 1e3:.1f} | {ratio:.3f} ({q1:.3f}-{q3:.3f}) |"
    )


def spec_name(spec: RunSpec) -> str:
    return f"p={spec.pp} m={spec.num_microbatches}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", choices=("1f1b", "interleaved-1f1b"), default="interleaved-1f1b")
    parser.add_argument("-p", type=int, default=4)
    parser.add_argument("--size", choices=("tiny", "large"), default="tiny")
    parser.add_argument("--iterations", type=int, default=82)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each setting, alternating")
    args = parser.parse_args()
    if not 2 <= args.p <= 8 or args.iterations <= args.warmup or args.repeats < 1:
        parser.error("-p in 2..8, --iterations above --warmup, --repeats >= 1")
    v = 2 if args.schedule == "interleaved-1f1b" else None
    m = num_microbatches(args.p)
    spec = RunSpec(
        pp=args.p,
        num_microbatches=m,
        schedule_csv=generate(args.schedule, args.p, m, v=v).to_csv(),
        model=model_spec(args.size),
        iterations=args.iterations,
        mode=AB,
        timeout_s=600.0,
        megatron_overlap_p2p=args.p == 2 and v is not None,  # megatron's batched p2p swaps the messages at p = 2
    )
    timed = args.iterations - args.warmup
    print(f"ours {args.schedule} vs megatron-core's own, {args.size}, {timed} paired iterations")
    print("| case | ours | ours ms | megatron ms | ours / megatron (quartiles) |")
    print("| --- | --- | --- | --- | --- |")
    for _ in range(args.repeats):
        for without in (False, True):
            print(one_run(spec, args.warmup, without), flush=True)


if __name__ == "__main__":
    main()
