"""zb-auto re-plans mid-training from a measured profile; the training math does not change."""

from __future__ import annotations

from megatron_pp_ext.verification import criterion
from megatron_pp_ext.verification.compare import compare
from megatron_pp_ext.verification.rank_pool import check_errors
from megatron_pp_ext.verification.reference import reference_runs
from megatron_pp_ext.verification.run_spec import OURS, RunSpec
from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec


def test_zb_auto_replans_mid_training_with_identical_math(pool):
    p, m, iterations = 4, 6, 4
    model = TinyGPTSpec(num_layers=p)
    spec = RunSpec(
        pp=p,
        mode=OURS,
        num_microbatches=m,
        model=model,
        iterations=iterations,
        split_backward=True,
        replan_schedule="zb-auto",
        # A tight limit and a deliberately wrong guess (W six times F): with any cost profile measured
        # on CPU (F > B > W) zb-auto then picks another order, so the run really switches schedules.
        replan_memory_limit=5,
        replan_initial_costs="1,1,6,0",
        profile_iterations=2,
        adam_eps=criterion.ADAM_EPS,
        lr=criterion.LR,
    )
    exact, ref = reference_runs(pool, spec)
    run = pool.run(spec)
    check_errors(run)
    used = run[0]["schedules_used"]
    assert used[0] != used[-1], "the re-planned schedule should differ from the initial one"
    assert all(r["measured_costs"] is not None for r in run)
    report = compare("zb-auto", p, m, 1, ref, run, exact=exact)
    assert report.problems == []
    assert report.ok, report  # loss and every gradient at every iteration, before and after the switch


def test_the_test_only_scale_hook_multiplies_the_named_times_and_refuses_bad_values() -> None:
    import pytest

    from megatron_pp_ext.runtime.replan import TEST_SCALE_ENV, parse_test_scale, scaled_for_test
    from megatron_pp_ext.schedules.costs import Costs

    measured = Costs(t_f=(1.0, 2.0), t_b=(3.0, 4.0), t_w=0.5, t_comm=0.1)
    scaled = scaled_for_test(measured, parse_test_scale("b=4, W=2"))
    got = (scaled.t_f, scaled.t_b, scaled.t_w, scaled.t_bw, scaled.t_comm)
    assert got == ((1.0, 2.0), (12.0, 16.0), 1.0, None, 0.1)
    for bad in ("b", "x=2", "b=0", "b=-1", "b=nan", "b=inf", "b=two"):
        with pytest.raises(ValueError, match=f"{TEST_SCALE_ENV} \\(test-only\\): expected KIND=FACTOR"):
            parse_test_scale(bad)
