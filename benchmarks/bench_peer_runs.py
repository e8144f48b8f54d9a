"""Real CPU runs: megatron-core's own 1F1B and interleaved 1F1B vs ours, same tiny GPT, same data.

Every iteration runs megatron's ``forward_backward_func`` and ours back to back on the same gloo ranks,
model and data, alternating which goes first (bench/ab_timing.py, mode AB). Reported per case: the median
over iterations of ours / megatron's wall time (slowest rank per iteration, warm-up dropped), the peak
bytes autograd holds for backward per rank (parameters excluded; one extra iteration of each under
``SavedBytesMeter``), and whether every micro-batch loss is equal (bitwise) in every iteration.

    python benchmarks/bench_peer_runs.py [--iterations 12] [--warmup 2]
        [--gantt benchmarks/figures/peers_plan_vs_measured.png]

``--gantt``: one more traced run of ours (interleaved-1f1b, p=2, m=8, v=2: one rank per core) drawn as the
simulator's plan (costs = the run's own mean op times per stage) above the measured last iteration.
"""

from __future__ import annotations

import argparse
import statistics

from megatron_pp_ext.analysis.plot import draw_plan_vs_measured
from megatron_pp_ext.analysis.simulate import simulate
from megatron_pp_ext.bench import torch_pipelining
from megatron_pp_ext.schedules import generate
from megatron_pp_ext.schedules.costs import Costs
from megatron_pp_ext.verification.rank_pool import check_errors
from megatron_pp_ext.verification.rank_run import TrainingRankPool
from megatron_pp_ext.verification.run_spec import AB, NATIVE, OURS, RunSpec
from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec

# (our schedule, megatron's, p, m, v). Interleaving at p=2 runs megatron with overlap_p2p_comm (batched p2p
# would swap the activation and the gradient exchanged with the single peer: the PP = 2 trap, docs/architecture.md).
CASES = [
    ("1f1b", "1F1B", 2, 8, 1),
    ("1f1b", "1F1B", 4, 8, 1),
    ("interleaved-1f1b", "interleaved 1F1B", 4, 8, 2),
    ("interleaved-1f1b", "interleaved 1F1B (overlap_p2p_comm)", 2, 8, 2),
]
MODEL = TinyGPTSpec(
    num_layers=8, hidden_size=128, num_attention_heads=4, seq_length=64, vocab_size=512, micro_batch_size=2
)


def kib(x: float) -> str:
    return f"{x / 1024:.0f}"


def gantt(pool: TrainingRankPool, path: str) -> str:
    """Trace ours once and draw the plan (with the measured mean op times) above the measured iteration."""
    p, m = 2, 8
    schedule = generate("interleaved-1f1b", p, m, v=2)
    spec = RunSpec(
        pp=p, num_microbatches=m, schedule_csv=schedule.to_csv(), model=MODEL, iterations=3, trace=True, timeout_s=300.0
    )
    results = pool.run(spec, wall_timeout_s=3600)
    check_errors(results)
    times: dict[str, dict[int, float]] = {}
    for r in results:
        for kind, per_stage in r["trace"]["op_times_s"].items():
            for stage, t in per_stage.items():
                times.setdefault(kind, {})[int(stage)] = t
    stages = range(schedule.num_stages)
    t_f = tuple(times["F"][s] for s in stages)
    t_bw = tuple(times["BW"][s] for s in stages)
    costs = Costs(t_f, tuple(x / 2 for x in t_bw), tuple(x / 2 for x in t_bw), t_bw, 0.0)
    plan = simulate(schedule, costs)
    ops = [(rank, op, a, b) for rank, r in enumerate(results) for op, a, b in r["trace"]["last_iteration_ops"]]
    t0 = min(a for _, _, a, _ in ops)
    measured = [(rank, op, a - t0, b - t0) for rank, op, a, b in ops]
    draw_plan_vs_measured(plan, schedule, measured, path, plan_unit="s")
    span = max(b for *_, b in measured)
    return (
        f"Plan vs measured ({path}): interleaved-1f1b p={p} m={m} v=2, plan makespan {plan.makespan:.3f} s with the "
        f"run's mean op times and free communication, measured iteration {span:.3f} s."
    )


def torch_runtime_rows(pool: TrainingRankPool, iterations: int, warmup: int) -> list[str]:
    """torch.distributed.pipelining's Schedule1F1B / ScheduleInterleaved1F1B vs ours on the same megatron chunks."""
    rows = [
        "| ours | torch.distributed.pipelining | p | m | v | ours / torch wall time (median) | max rel. loss diff "
        "| peak saved KiB per rank, torch | ours |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    print("\n".join(rows), flush=True)
    for name, _, p, m, v in CASES:
        spec = torch_pipelining.TorchRunSpec(name, p, m, v, MODEL, iterations=iterations)
        results = pool.run_fn(torch_pipelining.run_on_rank, spec, p, wall_timeout_s=3600)
        check_errors(results)
        theirs = [max(r["step_times"]["torch"][i] for r in results) for i in range(iterations)][warmup:]
        ours = [max(r["step_times"]["ours"][i] for r in results) for i in range(iterations)][warmup:]
        ratio = statistics.median(b / a for a, b in zip(theirs, ours, strict=True))
        diff = max(
            abs(x - y) / abs(y)
            for r in results
            for a, b in zip(r["losses"]["torch"], r["losses"]["ours"], strict=True)
            for x, y in zip(a, b, strict=True)
        )
        peak_t = " / ".join(kib(r["peak_saved_bytes"]["torch"]) for r in results)
        peak_o = " / ".join(kib(r["peak_saved_bytes"]["ours"]) for r in results)
        cls = torch_pipelining.TORCH_CLASSES[name]
        rows.append(f"| {name} | {cls} | {p} | {m} | {v} | {ratio:.3f} | {diff:.1e} | {peak_t} | {peak_o} |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--iterations", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--gantt", default=None, help="also draw the plan next to a measured trace (PNG path)")
    parser.add_argument("--torch", action="store_true", help="also run torch.distributed.pipelining's runtime")
    args = parser.parse_args()
    print(
        "| ours | megatron-core | p | m | v | ours / megatron wall time (median) | losses equal "
        "| peak saved KiB per rank, megatron | ours |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    with TrainingRankPool(max(c[2] for c in CASES)) as pool:
        if args.gantt:
            print(gantt(pool, args.gantt) + "\n")
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
                megatron_overlap_p2p=p == 2 and v > 1,
            )
            results = sorted(pool.run(spec, wall_timeout_s=3600), key=lambda r: r.get("pp_rank", 0))
            check_errors(results)
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
        if args.torch:
            print()
            torch_runtime_rows(pool, args.iterations, args.warmup)
    print(
        f"\n{args.iterations - args.warmup} iterations after {args.warmup} warm-up; "
        f"tiny GPT: {MODEL.num_layers} layers, hidden {MODEL.hidden_size}, seq {MODEL.seq_length}, "
        f"micro-batch {MODEL.micro_batch_size}, fp32, one thread per rank, gloo on a 2-core machine "
        "(p=4 runs 2 ranks per core)."
    )


if __name__ == "__main__":
    main()
