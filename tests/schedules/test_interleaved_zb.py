"""interleaved-zb and zb-auto with v chunks: never slower than torch's ZB1P order under the same costs,
memory limits honoured (all timed by analysis.simulate, independent of the generator's engine)."""

from __future__ import annotations

import math

import pytest

from megatron_pp_ext.analysis import simulate
from megatron_pp_ext.analysis.torch_orders import import_torch_schedule
from megatron_pp_ext.schedules import ScheduleError, generate
from megatron_pp_ext.schedules.costs import Costs, stage_costs
from megatron_pp_ext.schedules.generators.interleaved_zb import POLICIES, interleaved_zb_order

#: Per 1F1B stage: T_F, T_B, T_W, T_comm (unit; bench_zero_bubble's ratios; the zero-bubble paper's 1.5B at p=8).
COSTS = {"unit": (1.0, 1.0, 1.0, 0.0), "profiled": (1.0, 1.1, 0.6, 0.05), "zb-1.5b": (18.522, 18.086, 9.337, 0.601)}


def _half(model: str) -> Costs:
    f, b, w, comm = COSTS[model]
    return Costs(f / 2, b / 2, w / 2, None, comm)  # a stage of a 2-chunk schedule holds half a rank's layers


@pytest.mark.parametrize("model", list(COSTS))
@pytest.mark.parametrize("p", [2, 4, 8])
def test_not_slower_than_torch_zb1p_at_its_memory(model: str, p: int) -> None:
    costs = _half(model)
    for m in (p, 2 * p, 3 * p, 4 * p):
        torch = simulate(import_torch_schedule("InterleavedZeroBubble", p, m).schedule, costs)
        ours = simulate(generate("interleaved-zb", p, m, v=2, costs=costs), costs)
        assert ours.makespan <= torch.makespan * (1 + 1e-9), (model, p, m, ours.makespan, torch.makespan)
        assert max(ours.peak_activations_1f1b_units) <= max(torch.peak_activations_1f1b_units), (model, p, m)


@pytest.mark.parametrize(("p", "v"), [(1, 2), (2, 2), (3, 3), (4, 2), (5, 4)])
def test_memory_limit_is_honoured(p: int, v: int) -> None:
    costs = Costs(1.0, 1.3, 0.7, None, 0.1)
    for m in (1, p, 2 * p + 1, 3 * p):
        for limit in (None, 1, 1.5, p / 2, p, 2 * p, math.inf):
            if limit is not None and limit < 1:
                continue
            schedule = generate("interleaved-zb", p, m, v=v, costs=costs, memory_limit=limit)
            peak = max(simulate(schedule, costs).peak_activations_1f1b_units)
            assert peak <= (p if limit is None else limit) + 1e-9, (p, m, v, limit, peak)
            assert schedule.chunks_per_rank == v


def test_zb_auto_with_chunks_searches_at_least_interleaved_zb() -> None:
    for model in COSTS:
        costs = _half(model)
        for p, m in ((2, 4), (4, 8), (4, 10), (8, 16)):
            auto = simulate(generate("zb-auto", p, m, v=2, costs=costs, memory_limit=2 * p), costs)  # p M_a
            izb = simulate(generate("interleaved-zb", p, m, v=2, costs=costs), costs)
            assert auto.makespan <= izb.makespan * (1 + 1e-9)
            assert max(auto.peak_activations_1f1b_units) <= p
            default = simulate(generate("zb-auto", p, m, v=2, costs=costs), costs)  # 2p M_a, zb-auto's default bytes
            assert max(default.peak_activations_1f1b_units) <= 2 * p and default.makespan <= auto.makespan + 1e-9


def test_zb_auto_with_chunks_refuses_a_limit_below_one_microbatch() -> None:
    with pytest.raises(ScheduleError, match=r"memory_limit >= v = 3"):
        generate("zb-auto", 4, 8, v=3, memory_limit=2)


def test_tight_limits_build_where_uneven_warmups_stall() -> None:
    # v=5 at 8 stage activations (1.6 M_a): the group shrinks to 1 and every k >= 1 policy stalls
    schedule = generate("interleaved-zb", 4, 5, v=5, memory_limit=1.6)
    assert schedule.params["candidate"] == POLICIES[-1].name
    assert max(simulate(schedule).peak_activations_1f1b_units) <= 1.6 + 1e-9
    for p in range(1, 7):
        for v in range(2, 6):
            for m in (1, p, 2 * p + 1):
                for limit in range(v, min(v * m, 3 * v + 3) + 1):  # stage activations
                    assert interleaved_zb_order(p, m, v, stage_costs(None, p * v), limit, POLICIES[-1]), (p, m, v)


# ---- zb-auto with v chunks: W memory fraction and the span objective (as at v = 1) ---------------------
@pytest.mark.parametrize("objective", ["makespan", "span"])
@pytest.mark.parametrize("w", [0.6, 0.3])
def test_zb_auto_with_chunks_honours_the_limit_with_w_memory_exactly(objective: str, w: float) -> None:
    """The limit (stage activations) counted as the simulator counts with ``w_retained_fraction``: never
    exceeded, reached within one activation in most cases, and the room a W's smaller share leaves is used
    (the same order counted with whole activations until W exceeds the limit)."""
    costs, v = Costs(0.5, 0.55, 0.3, None, 0.05), 2
    tight = beyond_whole = 0
    for p in (2, 3, 4):
        for m in (p, 2 * p + 1, 3 * p):
            for limit in sorted({v, p, p + 1, 2 * p, 3 * p}):
                schedule = generate(
                    "zb-auto", p, m, v=v, costs=costs, memory_limit=limit, objective=objective, w_memory=w
                )
                assert schedule.params["w_memory"] == w and schedule.chunks_per_rank == v
                peak = max(simulate(schedule, costs, w_retained_fraction=w).peak_activations)
                assert peak <= limit + 1e-9, (p, m, limit, peak)
                tight += peak > limit - 1
                beyond_whole += max(simulate(schedule, costs).peak_activations) > limit + 1e-9
    assert tight >= 35 and beyond_whole >= 5, (tight, beyond_whole)  # of 42 cases


#: (T_F, T_B, T_W, T_comm) per stage of a 2-chunk schedule, p, m, limit (stage activations), w_memory
SPAN_SHAPES = [
    ((0.5, 0.5, 1.0, 0.05), 4, 9, 12, 0.6),
    ((0.5, 0.5, 1.0, 0.05), 6, 13, 18, 0.3),
    ((9.261, 9.043, 4.6685, 0.601), 4, 12, 8, 1.0),
    ((9.261, 9.043, 4.6685, 0.601), 4, 8, None, 0.3),
    ((0.5, 0.55, 0.3, 0.05), 8, 24, 16, 1.0),
]


def test_zb_auto_with_chunks_span_objective_not_slower_post_validated() -> None:
    """The span objective's post-validated time per iteration (simulator, 3 back-to-back iterations without
    step synchronisation) is at most the makespan objective's, strictly below on some shapes; the time it
    records is the simulator's."""
    better = 0
    for (f, b, w_time, comm), p, m, limit, w in SPAN_SHAPES:
        costs = Costs(f, b, w_time, None, comm)
        times = {}
        for objective in ("makespan", "span"):
            schedule = generate("zb-auto", p, m, v=2, costs=costs, memory_limit=limit, objective=objective, w_memory=w)
            result = simulate(schedule, costs, iterations=3, post_validation=True, w_retained_fraction=w)
            assert result.iterations is not None
            times[objective] = result.iterations.time
            if objective == "span":
                assert schedule.params["objective"] == "span"
                assert schedule.params["iteration_time"] == pytest.approx(result.iterations.time, rel=1e-9)
                assert schedule.params["makespan"] == pytest.approx(result.makespan, rel=1e-9)
        assert times["span"] <= times["makespan"] + 1e-9, (p, m, limit, w, times)
        better += times["span"] < times["makespan"] - 1e-9
    assert better >= 2


def test_zb_auto_with_chunks_checks_objective_and_w_memory_and_keeps_defaults() -> None:
    with pytest.raises(ScheduleError, match="objective"):
        generate("zb-auto", 4, 8, v=2, objective="fastest")
    with pytest.raises(ScheduleError, match="w_memory"):
        generate("zb-auto", 4, 8, v=2, w_memory=1.5)
    params = generate("zb-auto", 4, 8, v=2).params
    assert "objective" not in params and "w_memory" not in params
