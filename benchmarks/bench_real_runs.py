"""Real CPU runs of schedules: measured peak activation bytes and bubble rate, next to the simulator.

Each schedule trains a GPTModel (megatron-core, local spec, fp32) on gloo ranks through our
executor with the tracer on. The tracer measures, per rank,

* live activation bytes: what autograd saved for backward in each forward (parameters
  excluded) until the backward op that releases it, plus what the weight-gradient store holds
  between B and W; the figure is the peak over the last iteration;
* bubble rate: (iteration wall time - time inside compute ops) / iteration wall time,
  averaged over the iterations after warm-up.

Peak bytes are shown relative to 1F1B's on the same rank, next to the simulator's ratio of
peak live activations (w_retained_fraction = the measured store/activation ratio of the split
schedules, and 1.0). The embedding / output layer's own activations (rank 0 under V, first and
last rank under 1F1B) are part of the measured bytes: the "layers only" column subtracts them.

    python benchmarks/bench_real_runs.py --p 2 --m 8 --schedules 1f1b,zb-h1,zb-h2,zb-auto
"""

from __future__ import annotations

import argparse
import statistics

from megatron_pp_ext.analysis.schedule_check import validate
from megatron_pp_ext.analysis.simulate import simulate
from megatron_pp_ext.schedules import generate
from megatron_pp_ext.schedules.costs import Costs
from megatron_pp_ext.verification.rank_pool import check_errors
from megatron_pp_ext.verification.rank_run import TrainingRankPool
from megatron_pp_ext.verification.run_spec import OURS, RunSpec
from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec


def measure(pool: TrainingRankPool, name: str, p: int, m: int, iterations: int, warmup: int) -> dict:
    schedule = generate(name, p, m)
    layers_per_stage = 2 if schedule.placement.style == "loop" else 1
    model = TinyGPTSpec(
        num_layers=schedule.placement.stages_per_replica * layers_per_stage,
        hidden_size=256,
        num_attention_heads=8,
        seq_length=128,
        vocab_size=512,
        micro_batch_size=2,
    )
    split = schedule.splits_backward
    spec = RunSpec(
        pp=p,
        num_microbatches=m,
        schedule_csv=schedule.to_csv(),
        mode=OURS,
        model=model,
        iterations=iterations,
        trace=True,
        split_backward=split,
        keep_grads=False,
        timeout_s=300.0,
    )
    results = pool.run(spec, wall_timeout_s=3600)
    check_errors(results)
    by_rank = sorted(results, key=lambda r: r["pp_rank"])
    peak = [r["trace"]["per_iteration"][-1]["peak_activation_bytes"] for r in by_rank]
    bubble = [statistics.mean(it["bubble_rate"] for it in r["trace"]["per_iteration"][warmup:]) for r in by_rank]
    op_times: dict[str, dict[int, float]] = {}
    for r in by_rank:
        for kind, per_stage in r["trace"]["op_times_s"].items():
            op_times.setdefault(kind, {}).update(per_stage)
    stage_bytes: dict[int, int] = {}
    for r in by_rank:
        stage_bytes.update({int(k): v for k, v in r["trace"]["stage_activation_bytes"].items()})
    return {"schedule": schedule, "peak": peak, "bubble": bubble, "op_times": op_times, "stage_bytes": stage_bytes}


def measured_costs(op_times: dict[str, dict[int, float]], num_stages: int) -> Costs:
    """Per-stage costs from the traced op durations (BW split evenly where a schedule ran no B/W)."""

    def per_stage(kind: str) -> tuple[float, ...]:
        return tuple(op_times.get(kind, {}).get(s, 0.0) for s in range(num_stages))

    t_f, t_b, t_w, t_bw = per_stage("F"), per_stage("B"), per_stage("W"), per_stage("BW")
    if not any(t_b):
        t_b = tuple(x / 2 for x in t_bw)
        t_w = tuple(x / 2 for x in t_bw)
    return Costs(t_f=t_f, t_b=t_b, t_w=t_w, t_bw=t_bw if any(t_bw) else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--p", type=int, default=2)
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--schedules", default="1f1b,zb-h1,zb-h2,zb-auto")
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--retained", type=float, default=0.8, help="store/activation ratio for the simulator")
    args = parser.parse_args()
    names = args.schedules.split(",")
    with TrainingRankPool(args.p) as pool:
        rows = {name: measure(pool, name, args.p, args.m, args.iterations, args.warmup) for name in ["1f1b", *names]}
    base = rows["1f1b"]
    base_sim = simulate(base["schedule"], lowered=validate(base["schedule"]))
    print(
        "| schedule | rank | measured peak activation bytes | / 1F1B's (measured) | / 1F1B's (simulator, "
        f"w_retained={args.retained:g}) | / 1F1B's (simulator, 1.0) | measured bubble rate "
        "| simulated bubble (unit costs) | simulated bubble (measured op times) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in names:
        row = rows[name]
        sched = row["schedule"]
        lowered = validate(sched)
        sim_w = simulate(sched, lowered=lowered, w_retained_fraction=args.retained)
        sim_1 = simulate(sched, lowered=lowered)
        sim_measured = simulate(sched, measured_costs(row["op_times"], sched.num_stages), lowered=lowered)
        for r in range(args.p):
            print(
                f"| {name} | {r} | {row['peak'][r] / 2**20:.2f} MiB | {row['peak'][r] / base['peak'][r]:.2f} "
                f"| {sim_w.peak_activations_1f1b_units[r] / base_sim.peak_activations_1f1b_units[r]:.2f} "
                f"| {sim_1.peak_activations_1f1b_units[r] / base_sim.peak_activations_1f1b_units[r]:.2f} "
                f"| {row['bubble'][r]:.3f} | {sim_1.sync_bubble_rate_per_rank[r]:.3f} "
                f"| {sim_measured.sync_bubble_rate_per_rank[r]:.3f} |"
            )
    print(
        "\n| schedule | worst-rank peak / 1F1B's worst rank (measured) | (simulator, w_retained="
        f"{args.retained:g}) | (simulator, 1.0) |"
    )
    print("| --- | --- | --- | --- |")
    for name in names:
        sched = rows[name]["schedule"]
        lowered = validate(sched)
        sim_w = simulate(sched, lowered=lowered, w_retained_fraction=args.retained)
        sim_1 = simulate(sched, lowered=lowered)
        print(
            f"| {name} | {max(rows[name]['peak']) / max(base['peak']):.2f} "
            f"| {max(sim_w.peak_activations_1f1b_units) / max(base_sim.peak_activations_1f1b_units):.2f} "
            f"| {max(sim_1.peak_activations_1f1b_units) / max(base_sim.peak_activations_1f1b_units):.2f} |"
        )
    for name in names:
        sb = rows[name]["stage_bytes"]
        last = max(sb)
        middle = sorted(sb[s] for s in sb if 0 < s < last)
        mid = middle[len(middle) // 2] if middle else 0
        print(
            f"\n{name}: one micro-batch's saved activations per stage: middle stages {mid / 2**20:.2f} MiB; "
            f"stage 0 (embedding) {sb[0] / 2**20:.2f} MiB (+{(sb[0] - mid) / 2**20:.2f}); stage {last} "
            f"(final norm, output layer, loss) {sb[last] / 2**20:.2f} MiB (+{(sb[last] - mid) / 2**20:.2f})."
        )
    print(
        f"\np={args.p}, m={args.m}, {args.iterations} iterations ({args.warmup} warm-up), hidden 256, seq 128, "
        "micro-batch 2, fp32, gloo, one thread per rank."
    )


if __name__ == "__main__":
    main()
