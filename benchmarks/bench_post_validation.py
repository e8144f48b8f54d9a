"""Optimizer post-validation on real gloo ranks: what it keeps and what its step costs.

For each case, the same 1f1b run (tiny GPTModel, m = 2p, 3 Adam steps of megatron's optimizer with a
constant loss scaler) is stepped by megatron's synchronous ``ChainedOptimizer.step()`` and by
``PostValidatedOptimizer``. Prints, per pipeline stage: parameter bytes, the snapshot kept for a
rollback, rollbacks / redone steps, and the median wall time of ``optimizer.step()`` (CPU, one thread
per rank: indicative only; includes the wait for the previous stage's state). Weights are compared too.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/bench_post_validation.py [-p 2 4] [--clip 0 1.2]
"""

from __future__ import annotations

import argparse
import statistics

from megatron_pp_ext.schedules import registry
from megatron_pp_ext.verification.post_validation_check import compare_weights, run_pair
from megatron_pp_ext.verification.rank_run import TrainingRankPool


def _param_bytes(result: dict) -> int:
    return sum(w.numel() * w.element_size() for w in result["weights"].values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-p", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--clip", type=float, nargs="+", default=[0.0, 1.2])
    args = parser.parse_args()
    print(
        "| p | clip | stage | param bytes | snapshot bytes | eager decisions | rollbacks | redone | "
        "step ms sync | step ms post-validated | validate ms | weights |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    with TrainingRankPool(max(args.p)) as pool:
        for p in args.p:
            schedule = registry.generate("1f1b", p, 2 * p)
            for clip in args.clip:
                sync, post = run_pair(schedule, pool, clip_grad=clip)
                report = compare_weights(schedule.name, sync, post)
                equal = "bitwise" if report.bitwise_equal else f"max diff {report.max_abs_weight_diff:.2g}"
                by_stage = {r["pp_rank"]: r for r in post}
                sync_by_stage = {r["pp_rank"]: r for r in sync}
                for stage, stats in enumerate(report.stats):
                    ms_sync = 1e3 * statistics.median(sync_by_stage[stage]["optimizer_times"])
                    ms_post = 1e3 * statistics.median(by_stage[stage]["optimizer_times"])
                    validations = by_stage[stage]["validation_times"][1:]  # the first has nothing to validate
                    ms_validate = 1e3 * statistics.median(validations) if validations else 0.0
                    print(
                        f"| {p} | {clip:g} | {stage} | {_param_bytes(by_stage[stage])} | {stats['snapshot_bytes']} | "
                        f"{stats['eager']} | {stats['rollbacks']} | {stats['redos']} | {ms_sync:.1f} | "
                        f"{ms_post:.1f} | {ms_validate:.1f} | {equal} |"
                    )


if __name__ == "__main__":
    main()
