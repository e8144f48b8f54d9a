"""Our overlapped runs against megatron-core's OWN interleaved combined 1F1B, on real gloo ranks.

EP = 2 x PP = 2 (4 ranks), the tiny MoE GPT with four layers. megatron's interleaved 1F1B with
``overlap_moe_expert_parallel_comm`` runs every step as a combined forward-backward step, with one extra
warm-up micro-batch per rank; our executor runs the overlapped order of a schedule
(``analysis/overlap_order.py``) through the same combined step.

* interleaved-1f1b is megatron's own order: ``verify`` runs megatron's interleaved combined 1F1B on the
  same ranks too, and ours must make the same combined steps (which forward with which backward, per
  rank) and give bitwise the same losses and gradients, besides passing the criterion.
* 1f1b (two layers a stage, the same model) pairs other micro-batches, so only the results compare: every
  micro-batch loss and the summed gradients within ``verify``'s criterion, with megatron's interleaved
  combined 1F1B as the fp32 run beside the exact one (which must itself pass against the references).
"""

from __future__ import annotations

import dataclasses

from megatron_pp_ext.schedules import generate
from megatron_pp_ext.verification import criterion
from megatron_pp_ext.verification.compare import compare
from megatron_pp_ext.verification.rank_pool import check_errors
from megatron_pp_ext.verification.reference import reference_runs
from megatron_pp_ext.verification.run_spec import NATIVE, OURS, RunSpec
from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec
from megatron_pp_ext.verification.verify import verify_schedule

P, M, DP, EP = 2, 4, 2, 2
MODEL = TinyGPTSpec(num_layers=4, num_experts=4, moe_topk=2)  # one layer a stage of interleaved-1f1b (v = 2)


def test_overlapped_interleaved_makes_megatrons_combined_steps(pool) -> None:
    schedule = generate("interleaved-1f1b", P, M)
    report = verify_schedule(schedule, pool, model=MODEL, dp=DP, ep=EP, overlap_moe=True, iterations=1)
    assert report.problems == []
    assert report.bitwise_megatron_combined is True
    assert report.ok, report.describe()


def _megatron_combined(pool, spec: RunSpec) -> list[dict]:
    """megatron's interleaved combined 1F1B (v = 2) on ``spec``'s ranks, model and data."""
    interleaved = generate("interleaved-1f1b", P, M)
    run = pool.run(
        dataclasses.replace(spec, mode=NATIVE, schedule_csv=interleaved.to_csv(), record_combined_steps=True)
    )
    check_errors(run)
    return run


def test_overlapped_1f1b_matches_megatrons_combined_1f1b(pool) -> None:
    schedule = generate("1f1b", P, M)
    ours = RunSpec(
        pp=P,
        num_microbatches=M,
        dp=DP,
        ep=EP,
        overlap_moe=True,
        mode=OURS,
        schedule_csv=schedule.to_csv(),
        model=MODEL,
        iterations=1,
        adam_eps=criterion.ADAM_EPS,
        lr=criterion.LR,
    )
    exact, ref = reference_runs(pool, ours)
    megatron = _megatron_combined(pool, ours)
    steps = [s for r in megatron for s in r["combined_steps"][0]]
    assert any(f is not None and b is not None for f, b in steps)  # megatron paired forwards with backwards
    theirs = compare("interleaved-1f1b", P, M, 2, ref, megatron, exact=exact)
    assert theirs.ok, theirs.describe()  # megatron's combined 1F1B itself is right
    run = pool.run(ours)
    check_errors(run)
    report = compare("1f1b", P, M, 1, megatron, run, exact=exact)
    assert report.problems == []
    assert report.ok, report.describe()
