"""ZeroPP on real gloo ranks: measured peak bytes per rank against the memory models.

p=2 x dp=2 (4 CPU ranks), FSDP with one gathered chunk, the verify harness's tiny GPT (4 layers, untied
embeddings, fp32), 2 iterations; every run is also checked against the unpartitioned reference (``ok``).

Two tables:

1. Activations and gathered parameters, per rank: the measured peaks (the executor's trace; ``ShardedChunk``'s
   memory counters) next to the models: the simulator's peak live activation bytes (each stage's measured
   activation size x the simulated live count, an activation held from F until its W: ``w_retained_fraction
   = 1``, the papers' counting) and :mod:`megatron_pp_ext.analysis.fsdp_memory`'s gathered parameters (from
   the lowering's unshard/reshard).
2. Full gradient buffers with ZeroPP's gradient reduce-scatter per unit against once per iteration (the same
   schedule with ``fsdp_grad_reduce_unit = m``): reduce-scatters per iteration (lowering / measured), peak
   full-gradient bytes (model / measured) and the time-averaged full-gradient bytes (model: mean over the ops;
   measured: over wall time, ``FsdpMemory.mean_bytes``).

    PYTHONPATH=. python benchmarks/bench_zeropp_real.py   # a few minutes on 2 cores
"""

from __future__ import annotations

from typing import Any

from megatron_pp_ext.analysis.fsdp_memory import FsdpBufferPeaks, fsdp_buffer_peaks
from megatron_pp_ext.analysis.simulate import simulate
from megatron_pp_ext.schedules import Schedule, generate
from megatron_pp_ext.schedules.collectives import CollectiveKind, derive_collectives, policy_for
from megatron_pp_ext.verification.rank_run import TrainingRankPool
from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec
from megatron_pp_ext.verification.verify import verify_schedule
from megatron_pp_ext.verification.verify_report import VerifyReport

MODEL = TinyGPTSpec(num_layers=4, tied_embeddings=False)
CASES: list[tuple[str, dict[str, int]]] = [
    ("1f1b", {}),
    ("zeropp", {"v": 2, "unit_size": 1}),
    ("zeropp", {"v": 2, "unit_size": 2}),
    ("zeropp", {"v": 2, "unit_size": 4}),
    ("bfs", {"v": 2}),
]
KB = 1e3


def run(pool: TrainingRankPool, schedule: Schedule, unit: int | None = None) -> VerifyReport:
    return verify_schedule(
        schedule, pool, model=MODEL, dp=2, fsdp=True, fsdp_max_unsharded=1, fsdp_grad_reduce_unit=unit, iterations=2
    )


def models(schedule: Schedule, report: VerifyReport, unit: int | None = None) -> tuple[list[float], FsdpBufferPeaks]:
    """The simulator's activation peaks in bytes and the lowering's FSDP buffer peaks, per rank."""
    placement = schedule.placement
    per_stage = [float(report.stage_activation_bytes[placement.rank_of(s)][s]) for s in range(schedule.num_stages)]
    activations = simulate(schedule, activation_bytes=per_stage).peak_activation_bytes
    assert activations is not None
    sizes = [
        float(report.fsdp[placement.rank_of(s)]["full_param_bytes_per_chunk"][placement.chunk_of(s)])
        for s in range(schedule.num_stages)
    ]
    plan = derive_collectives(schedule, policy_for(schedule, fsdp=True, fsdp_max_unsharded=1, grad_reduce_unit=unit))
    return list(activations), fsdp_buffer_peaks(plan, sizes)


def pair(values: Any) -> str:
    return " / ".join(f"{v / KB:.0f}" for v in values)


def main() -> None:
    print("Activations and gathered parameters (KB per rank, rank 0 / rank 1; model = simulator / lowering):\n")
    print(
        "| schedule | m | ok | activations measured | activations model | params measured | params model "
        "| params + activations measured | model |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    grads: list[str] = []
    with TrainingRankPool(4) as pool:
        for name, kwargs in CASES:
            for m in (4, 8):
                schedule = generate(name, 2, m, **kwargs)  # type: ignore[arg-type]
                report = run(pool, schedule)
                act_model, buffers = models(schedule, report)
                act = report.peak_activation_bytes
                params = [info["peak_bytes"]["full_params"] for info in report.fsdp]
                label = name + "".join(f" {k}={v}" for k, v in kwargs.items())
                both = [a + p for a, p in zip(act, params, strict=True)]
                both_model = [a + p for a, p in zip(act_model, buffers.params, strict=True)]
                print(
                    f"| {label} | {m} | {report.ok} | {pair(act)} | {pair(act_model)} | {pair(params)} "
                    f"| {pair(buffers.params)} | {pair(both)} | {pair(both_model)} |",
                    flush=True,
                )
                if name != "zeropp" or kwargs["unit_size"] >= m:
                    continue
                for reduce_unit, what in ((None, "per unit"), (m, "per iteration")):
                    r = report if reduce_unit is None else run(pool, schedule, reduce_unit)
                    _, b = models(schedule, r, reduce_unit)
                    plan = derive_collectives(
                        schedule, policy_for(schedule, fsdp=True, fsdp_max_unsharded=1, grad_reduce_unit=reduce_unit)
                    )
                    derived = [plan.count(CollectiveKind.REDUCE_GRADS, rank) for rank in range(2)]
                    measured = [info["reduce_scatters_per_iteration"][-1] for info in r.fsdp]
                    peak = [info["peak_bytes"]["full_grads"] for info in r.fsdp]
                    mean = [info["mean_bytes"]["full_grads"] for info in r.fsdp]
                    grads.append(
                        f"| {label} | {m} | {what} | {r.ok} | {derived} / {measured} | {pair(b.grads)} | {pair(peak)} "
                        f"| {pair(b.mean_grads)} | {pair(mean)} |"
                    )
    print("\nFull gradient buffers, reduce-scatter per unit vs once per iteration (KB per rank, rank 0 / rank 1):\n")
    print(
        "| schedule | m | gradient reduce-scatter | ok | reduce-scatters per iteration, lowering / measured "
        "| peak full gradients, model | measured | mean full gradients, model (over ops) | measured (over wall time) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(grads))


if __name__ == "__main__":
    main()
