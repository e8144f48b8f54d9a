"""Optimizer post-validation on real gloo ranks against megatron-core's synchronous step.

Every case runs the same schedule, model, data and megatron optimizer (Adam through
``get_megatron_optimizer``, loss scaling with found-inf skip) twice on the same ranks: stepped by
megatron's ``ChainedOptimizer.step()`` and by ``PostValidatedOptimizer``; the weights after the
last step must be bitwise equal. The clip thresholds lie between stage 0's partial gradient norm
and the complete one in the first step(s) of the tiny model (measured, p=2: 1.43 / 1.91 in the
first step, p=4: 1.09 / 1.76), so stages step unclipped, are rolled back and redo the step clipped;
the tests assert that this happened (rollback and redo counts), so a model change that moves the
norms fails loudly instead of silently testing nothing.
"""

from __future__ import annotations

import math

import pytest

from megatron_pp_ext.schedules import registry
from megatron_pp_ext.verification.post_validation_check import compare_weights, run_pair
from tests.runtime import post_validation_helpers as helpers

CLIP = {2: 1.6, 4: 1.2}  # by pipeline size


def _schedule(p: int) -> object:
    return registry.generate("1f1b", p, 2 * p)


@pytest.mark.parametrize("p", [2, 4])
def test_nothing_clipped_or_skipped_is_bitwise_and_never_rolls_back(pool, p):
    schedule = _schedule(p)
    report = compare_weights(schedule.name, *run_pair(schedule, pool))
    _assert_matches_synchronous(report, 0.0)  # no clipping: bitwise
    assert report.compared > 0 and report.rollbacks == 0 and report.redos == 0
    for stage, stats in enumerate(report.stats):
        assert stats["eager"] == {"plain": 3}, (stage, stats)
        assert stats["validations"] == 3
        # only stages whose step may be undone keep a copy; the last stage's state is complete
        assert (stats["snapshot_bytes"] > 0) == (stage < p - 1)


def _assert_matches_synchronous(report, clip: float) -> None:
    """Every stage validated against the synchronous norm of each step, up to the association of
    the partial sums (megatron all-reduces them in the backend's order, we add them in pipeline order:
    equal for two terms; otherwise at most a float32 ulp or two of the norm squared). Weights: bitwise
    when no step clipped with a norm that differs; else within :func:`_weight_allowance`."""
    clipped_differently = False
    for stats in report.stats:
        for mine, theirs in zip(stats["complete_norms"], report.sync_norms, strict=True):
            if math.isinf(theirs):
                assert math.isinf(mine)
                continue
            assert abs(mine**2 - theirs**2) <= 2 * 2.0**-23 * theirs**2, (mine, theirs)
            clipped_differently |= mine != theirs and clip > 0 and theirs > clip
    if clipped_differently:
        assert report.max_abs_weight_diff <= _weight_allowance(report, clip), report
    else:
        assert report.bitwise_equal, report


LR = 1e-3  # run_pair's learning rate


def _weight_allowance(report, clip: float) -> float:
    """How far the weights may move when both runs clip with norms that differ in the last bits.

    Derived, not measured: the norms agree to ``2 * 2**-23`` relative in the square (asserted above),
    so the clip coefficients ``clip / norm`` differ by ``delta <= 2**-23`` relative, and so does every
    clipped gradient element (each at most ``clip`` in size: an element is bounded by the norm). With
    Adam's eps = 1 (run_pair's default, the verification criterion's) the update ``m / (sqrt(v) + 1)``
    is Lipschitz in the gradient with constant ``(1 - beta1) / (1 - beta1**t) <= 1``, so one step moves
    a weight by at most ``lr * delta * clip`` more in one run than in the other. Later steps see weights
    that already differ, which a smooth loss amplifies by ``1 + lr * curvature`` per step; allowing
    :data:`criterion.GROWTH` per step covers curvature up to ``3 / lr``. A fault (a rollback that
    restores nothing, a redo skipped) moves weights by a whole update, ``~lr``: ~1e5x beyond this."""
    from megatron_pp_ext.verification import criterion

    steps = report.iterations
    return steps * LR * 2.0**-23 * clip * criterion.GROWTH**steps


@pytest.mark.parametrize("p", [2, 4])
def test_clipping_rolls_back_and_redoes_to_the_synchronous_weights(pool, p):
    schedule = _schedule(p)
    report = compare_weights(schedule.name, *run_pair(schedule, pool, clip_grad=CLIP[p]))
    _assert_matches_synchronous(report, CLIP[p])
    if p == 2:  # two partial sums: the same float32 sum in either order
        assert report.norms_equal and report.bitwise_equal, report
    first = report.stats[0]
    assert first["partial_norms"][0] < CLIP[p] < report.stats[-1]["partial_norms"][0], report.stats
    assert first["rollbacks"] >= 1 and first["redos"] >= 1, first
    assert report.stats[-1]["eager"].get("clip", 0) >= 1  # the last stage's state is complete: clips at once
    assert report.stats[-1]["rollbacks"] == 0


@pytest.mark.parametrize("p, inf_stage", [(2, 1), (4, 2)])
def test_inf_on_a_later_stage_rolls_back_the_earlier_ones(pool, p, inf_stage):
    schedule = _schedule(p)
    report = compare_weights(schedule.name, *run_pair(schedule, pool, inject_inf=((1, inf_stage),)))
    _assert_matches_synchronous(report, 0.0)  # no clipping: bitwise
    assert report.sync_norms[1] == float("inf")
    for stage, stats in enumerate(report.stats):
        # stages before the inf stepped eagerly and were rolled back; from it on they skipped at once
        assert stats["rollbacks"] == (1 if stage < inf_stage else 0), (stage, stats)
        assert stats["eager"].get("skip", 0) == (1 if stage >= inf_stage else 0), (stage, stats)


def test_a_rollback_that_restores_nothing_is_caught(pool):
    schedule = _schedule(2)
    sync, post = run_pair(schedule, pool, inject_inf=((1, 1),), fn=helpers.run_with_broken_rollback)
    report = compare_weights(schedule.name, sync, post)
    assert report.rollbacks == 1
    # the fault lands far outside what a last-bit clip difference may cause (so the allowance is sharp)
    assert report.max_abs_weight_diff > 1000 * _weight_allowance(report, max(CLIP.values())), report


@pytest.mark.parametrize("tp", [1, 2])
def test_no_collective_crosses_stages_inside_the_step(pool, tp):
    """megatron's step all-reduces over groups spanning the pipeline; the post-validated one only
    within a stage (its TP group), and exchanges the state with its pipeline neighbours instead;
    the complete state is received and validated after every step."""
    p = 4 // tp
    schedule = _schedule(p)
    sync, post = run_pair(schedule, pool, clip_grad=CLIP[p], tp=tp, fn=helpers.run_recording_step_communication)
    stage_of = {r["rank"]: r["pp_rank"] for r in post}

    def crossing(calls):
        return [c for c in calls if c[1] in helpers.COLLECTIVES and len({stage_of[rank] for rank in c[2]}) > 1]

    for r in post:
        assert crossing(r["calls"]) == [], r["calls"]
        p2p = [c for c in r["calls"] if c[1] in helpers.POINT_TO_POINT]
        stage = r["pp_rank"]
        peers = sorted({stage_of[c[3]] for c in p2p})
        expected = {stage - 1, stage + 1, p - 1} - {-1, p, stage} if stage < p - 1 else set(range(p - 1))
        assert peers == sorted(expected), (stage, p2p)
        assert r["post_validation"]["validations"] == 3
    report = compare_weights(schedule.name, sync, post)
    assert report.rollbacks >= 1
    if tp == 1:
        assert report.bitwise_equal, report
    else:  # megatron sums TP x PP partial norms in one all-reduce, we nest TP then the pipeline
        assert report.max_abs_weight_diff <= _weight_allowance(report, CLIP[p]), report


def test_megatrons_step_crosses_stages(pool):
    """The recorder sees megatron's own cross-stage all-reduces (so the check above can fail)."""
    from megatron_pp_ext.verification.run_spec import RunSpec
    from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec

    schedule = _schedule(2)
    spec = RunSpec(
        pp=2,
        num_microbatches=4,
        schedule_csv=schedule.to_csv(),
        megatron_optimizer=True,
        clip_grad=CLIP[2],
        loss_scale=1.0,
        keep_grads=False,
        model=TinyGPTSpec(num_layers=2),
    )
    results = pool.run_fn(helpers.run_recording_step_communication, spec, 2, 360)
    for r in results:
        assert "error" not in r, r
        stepped = [c for c in r["calls"] if c[0] == "step" and c[1] == "all_reduce" and len(c[2]) == 2]
        assert len(stepped) >= 3, r["calls"]  # found-inf and grad norm over both stages, every step


@pytest.mark.parametrize("case", ["clip", "inf"])
def test_distributed_optimizer_with_data_parallelism(pool, case):
    """p=2 x dp=2, megatron's DistributedOptimizer: statistics are reduced over the stage's
    data-parallel ranks (its reduce-scattered shards) and passed along the pipeline; the rollback
    restores each rank's shard of main parameters and optimizer state and the model parameters."""
    schedule = _schedule(2)
    clip = 1.2 if case == "clip" else 0.0  # stage 0's partial norm 1.08 / 1.00, complete 1.42 / 1.33 (steps 1, 2)
    inject = ((1, 1),) if case == "inf" else ()
    sync, post = run_pair(schedule, pool, dp=2, distributed_optimizer=True, clip_grad=clip, inject_inf=inject)
    report = compare_weights(schedule.name, sync, post)
    _assert_matches_synchronous(report, clip)
    assert report.stats[0]["rollbacks"] >= 1, report.stats
    assert {r["dp_rank"] for r in post} == {0, 1} and report.compared > 0


def test_without_scaler_clipping_or_skip_threshold_nothing_is_kept(pool):
    """megatron's FP32Optimizer (no loss scaler) without clipping: no complete state can change a
    stage's step, so no stage keeps a snapshot; the weights are still bitwise the synchronous ones."""
    schedule = _schedule(2)
    report = compare_weights(schedule.name, *run_pair(schedule, pool, loss_scale=None))
    _assert_matches_synchronous(report, 0.0)
    assert [s["snapshot_bytes"] for s in report.stats] == [0, 0]
    assert report.stats[0]["validations"] == 3


@pytest.mark.parametrize("p", [2, 4])
def test_late_validation_reruns_the_iteration_that_used_undone_weights(pool, p):
    """Validation after the next iteration's forward-backward (so that iteration never waits for the
    complete state): when validation changes some stage's weights (a clip in step 1, a later stage's
    inf in step 2), every stage runs that iteration again; the weights end bitwise as the synchronous ones."""
    schedule = _schedule(p)
    sync, post = run_pair(schedule, pool, clip_grad=CLIP[p], inject_inf=((1, p - 1),), late=True)
    report = compare_weights(schedule.name, sync, post)
    _assert_matches_synchronous(report, CLIP[p])
    assert [r["post_validation"]["reruns"] for r in post] == [2] * p, [r["post_validation"] for r in post]
    assert report.rollbacks >= 1
