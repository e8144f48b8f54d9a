"""ZeroPP on real gloo ranks: measured peak activation bytes per rank vs the simulator's peak (issue 15).

p=2 x dp=2 (4 CPU ranks), FSDP with one gathered chunk, the verify harness's tiny GPT (4 layers, untied
embeddings), 2 iterations; every run is also checked against the unpartitioned reference (``ok``). The
simulator counts an activation live from F until its W (``w_retained_fraction = 1``).

    PYTHONPATH=. python benchmarks/bench_zeropp_real.py   # ~1 minute on 2 cores
"""

from __future__ import annotations

from megatron_pp_ext.analysis.simulate import simulate
from megatron_pp_ext.schedules import generate
from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec
from megatron_pp_ext.verification.verify import RankPool, verify_schedule

CASES: list[tuple[str, dict[str, int]]] = [
    ("1f1b", {}),
    ("zeropp", {"v": 2, "unit_size": 1}),
    ("zeropp", {"v": 2, "unit_size": 2}),
    ("zeropp", {"v": 2, "unit_size": 4}),
    ("bfs", {"v": 2}),
]


def main() -> None:
    print(
        "| schedule | m | matches reference | simulated peak (M_a), rank 0 / 1 "
        "| measured peak activation KB, rank 0 / 1 |"
    )
    print("| --- | --- | --- | --- | --- |")
    with RankPool(4) as pool:
        for name, kwargs in CASES:
            for m in (4, 8):
                schedule = generate(name, 2, m, **kwargs)  # type: ignore[arg-type]
                peaks = [x / schedule.chunks_per_rank for x in simulate(schedule).peak_activations]
                report = verify_schedule(
                    schedule,
                    pool,
                    model=TinyGPTSpec(num_layers=4, tied_embeddings=False),
                    dp=2,
                    fsdp=True,
                    fsdp_max_unsharded=1,
                    iterations=2,
                )
                label = name + "".join(f" {k}={v}" for k, v in kwargs.items())
                measured = " / ".join(f"{b / 1e3:.0f}" for b in report.peak_activation_bytes)
                print(f"| {label} | {m} | {report.ok} | {peaks[0]:g} / {peaks[1]:g} | {measured} |", flush=True)


if __name__ == "__main__":
    main()
