"""BitPipe's measured peak activation bytes per rank against the simulator's, in bytes.

Runs ``1f1b`` and the bidirectional schedules on gloo ranks through our executor with the tracer on
(the GPTModel of ``bench_real_runs.py``: 2p layers, so a 1F1B stage holds two layers and a BitPipe
stage one). The tracer measures, per rank, the peak of live activation bytes in the last iteration
and, per stage, what one micro-batch's forward saved. The simulator is given those per-stage bytes
(``activation_bytes``) and predicts each rank's peak in bytes from the schedule alone
(``w_retained_fraction`` 1.0: an unsplit backward frees everything at once). The two agree when the
executor frees exactly what the schedule says; the embedding / loss stages' extra bytes are in both.

    python benchmarks/bench_bitpipe_memory.py --p 4 --m 8
"""

from __future__ import annotations

import argparse

from bench_real_runs import measure

from megatron_pp_ext.analysis.schedule_check import validate
from megatron_pp_ext.analysis.simulate import simulate
from megatron_pp_ext.verification.rank_run import TrainingRankPool


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--p", type=int, default=4)
    parser.add_argument("--m", type=int, default=8)
    parser.add_argument("--schedules", default="1f1b,bitpipe,bitpipe-zb")
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    names = args.schedules.split(",")
    with TrainingRankPool(args.p) as pool:
        rows = {name: measure(pool, name, args.p, args.m, args.iterations, args.warmup) for name in names}
    print(f"p={args.p}, m={args.m}; KiB = 1024 bytes\n")
    print("| schedule | rank | measured peak (KiB) | simulator peak (KiB) | measured / simulated | / 1F1B's measured |")
    print("| --- | --- | --- | --- | --- | --- |")
    base = rows.get("1f1b")
    for name in names:
        row = rows[name]
        schedule = row["schedule"]
        sizes = [float(row["stage_bytes"][s]) for s in range(schedule.num_stages)]
        predicted = simulate(schedule, lowered=validate(schedule), activation_bytes=sizes).peak_activation_bytes
        assert predicted is not None
        for rank in range(args.p):
            measured = row["peak"][rank]
            vs_1f1b = f"{measured / base['peak'][rank]:.2f}" if base else "-"
            print(
                f"| {name} | {rank} | {measured / 1024:.1f} | {predicted[rank] / 1024:.1f} "
                f"| {measured / predicted[rank]:.3f} | {vs_1f1b} |"
            )
    for name in names:
        sb = rows[name]["stage_bytes"]
        cells = ", ".join(f"{s}: {sb[s] / 1024:.1f}" for s in sorted(sb))
        print(f"\n{name}: one micro-batch's saved activations per stage (KiB): {cells}")


if __name__ == "__main__":
    main()
