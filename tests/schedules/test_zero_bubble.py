"""Zero-bubble schedules: ZB-H1, ZB-H2 and zb-auto, checked with the validator and the simulator.

Figures are unit costs (T_F = T_B = T_W = 1, no communication cost) unless a test says otherwise;
``bubble_rate`` is the zero-bubble paper's (longest per-rank span), ``sync_bubble_rate`` the
global makespan's. Peak activations use the simulator's default: live from F until its W.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_pp_ext.analysis import SimResult, simulate, validate
from megatron_pp_ext.cli import main
from megatron_pp_ext.schedules import Schedule, ScheduleError, generate, get, names
from megatron_pp_ext.schedules.costs import Costs
from megatron_pp_ext.schedules.generators.common import ScheduleParameterError
from megatron_pp_ext.schedules.generators.zero_bubble import (
    DEFAULT_VARIANTS,
    pair_receives,
    stage_costs,
    time_order,
    zb_h1_order,
    zb_h2_order,
)

UNIT = Costs.unit()
UNEQUAL = Costs(1.0, 1.1, 0.6, None, 0.05)  # T_F, T_B, T_W, (T_BW = B + W), T_comm


def grid_m(p: int) -> list[int]:
    """m < p, m = p, m not a multiple of p, m >= 2p; all within 1..4p."""
    return sorted({1, 2, p - 1, p, p + 1, 2 * p - 1, 2 * p, 2 * p + 1, 3 * p + 1, 4 * p} - {0})


GRID = [(p, m) for p in (2, 3, 4, 5, 7, 8, 12, 16) for m in grid_m(p)]
SMALL_GRID = [(p, m) for p, m in GRID if p <= 8]


@cache
def sim(name: str, p: int, m: int, costs: Costs = UNIT, memory_limit: float | None = None) -> SimResult:
    kwargs: dict[str, object] = {}
    if name == "zb-auto":
        kwargs = {"costs": costs, "memory_limit": memory_limit}
    schedule = generate(name, p, m, **kwargs)
    result = simulate(schedule, costs)  # validates first
    if name == "zb-auto":  # the generator's own timing is the simulator's
        assert result.makespan == pytest.approx(schedule.params["makespan"], rel=1e-9, abs=1e-9)
    return result


def idle(result: SimResult) -> float:
    """Bubble time of the longest per-rank span (the paper's C minus the work of one rank)."""
    return max(result.span) - max(result.busy)


# ---- registry, parameters ------------------------------------------------------------------------------
def test_registered() -> None:
    assert {"zb-h1", "zb-h2", "zb-auto"} <= set(names())
    for name in ("zb-h1", "zb-h2", "zb-auto"):
        info = get(name)
        assert info.placement == "loop" and info.splits_backward and info.family == "zero-bubble"


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2", "zb-auto"])
def test_kwargs(name: str) -> None:
    assert generate(name, 3, 5, v=1).num_stages == 3
    if name == "zb-auto":  # v >= 2: the loop placement with v chunks (interleaved_zb.zb_auto_looped)
        assert generate(name, 3, 5, v=2).num_stages == 6
    else:
        with pytest.raises(ScheduleParameterError, match="v must be 1"):
            generate(name, 3, 5, v=2)
    with pytest.raises(ScheduleParameterError, match="microbatch_group_size"):
        generate(name, 3, 5, microbatch_group_size=3)
    with pytest.raises(ScheduleParameterError, match="m must be >= 1"):
        generate(name, 3, 0)


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2"])
def test_handcrafted_refuse_a_memory_limit(name: str) -> None:
    with pytest.raises(ScheduleParameterError, match=r"memory_limit.*zb-auto"):
        generate(name, 4, 8, memory_limit=8)


@pytest.mark.parametrize("limit", [0, 0.5, -3, math.nan, True, "2p"])
def test_zb_auto_refuses_bad_memory_limits(limit: object) -> None:
    with pytest.raises(ScheduleParameterError, match="memory_limit"):
        generate("zb-auto", 4, 8, memory_limit=limit)


@dataclass
class DuckCosts:  # any object with t_f, t_b, t_w, t_comm
    t_f: object = 1.0
    t_b: object = 1.0
    t_w: object = 1.0
    t_comm: object = 0.0


@pytest.mark.parametrize(
    ("costs", "match"),
    [
        (DuckCosts(t_f=(1.0, 2.0)), "t_f lists 2 per-stage values"),
        (DuckCosts(t_b=-1.0), "t_b must be finite and >= 0"),
        (DuckCosts(t_w="x"), "t_w must be a number"),
        (DuckCosts(t_comm=(0.1, 0.1)), "t_comm must be one finite number"),
        (object(), "lacks t_f, t_b, t_w"),
    ],
)
def test_zb_auto_refuses_bad_costs(costs: object, match: str) -> None:
    with pytest.raises(ScheduleParameterError, match=match):
        generate("zb-auto", 3, 6, costs=costs)


def test_duck_typed_per_stage_costs() -> None:
    costs = DuckCosts(t_f=(1.0, 1.0, 1.5), t_b=(1.0, 1.2, 2.0), t_w=0.5, t_comm=0.1)
    schedule = generate("zb-auto", 3, 9, costs=costs, memory_limit=4)
    result = simulate(schedule, Costs(costs.t_f, costs.t_b, 0.5, None, 0.1))  # type: ignore[arg-type]
    assert max(result.peak_activations) <= 4
    assert result.makespan == pytest.approx(schedule.params["makespan"])


# ---- hand-checked orders -------------------------------------------------------------------------------
def rows(schedule: Schedule) -> list[str]:
    return [" ".join(map(str, row)) for row in schedule.ops]


def test_zb_h1_order() -> None:
    # 1F1B's F/B order; rank r keeps the W of its first r steady-state backwards for the end.
    assert rows(generate("zb-h1", 3, 4)) == [
        "F0.0 F0.1 F0.2 B0.0 W0.0 F0.3 B0.1 W0.1 B0.2 W0.2 B0.3 W0.3",
        "F1.0 F1.1 B1.0 F1.2 B1.1 W1.1 F1.3 B1.2 W1.2 B1.3 W1.3 W1.0",
        "F2.0 B2.0 F2.1 B2.1 F2.2 B2.2 W2.2 F2.3 B2.3 W2.3 W2.0 W2.1",
    ]


def test_zb_h2_parallelogram() -> None:
    # p=2, m=5: warm-up 2(p-r)-1 forwards, W passes deferred into free slots and the tail;
    # every rank busy from its first F to its last W.
    schedule = generate("zb-h2", 2, 5)
    assert rows(schedule) == [
        "F0.0 F0.1 F0.2 B0.0 F0.3 B0.1 W0.0 B0.2 F0.4 B0.3 W0.1 W0.2 B0.4 W0.3 W0.4",
        "F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 F1.3 B1.3 W1.0 F1.4 B1.4 W1.1 W1.2 W1.3 W1.4",
    ]
    result = simulate(schedule)
    assert result.bubble_rate == 0 and result.span == [15.0, 15.0]


@pytest.mark.parametrize(("p", "m"), [(p, m) for p in (2, 3, 4, 6) for m in (1, p, 2 * p + 1, 4 * p)])
def test_handcrafted_orders_need_no_early_receive(p: int, m: int) -> None:
    # pair_receives is the identity on them: the simulator's timing is plain dataflow timing.
    for order in (zb_h1_order, zb_h2_order):
        assert pair_receives(order(p, m)) == order(p, m)


# ---- unit costs over the grid --------------------------------------------------------------------------
@pytest.mark.parametrize(("p", "m"), GRID)
def test_zb_h1(p: int, m: int) -> None:
    h1, one_f_one_b = sim("zb-h1", p, m), sim("1f1b", p, m)
    assert max(h1.peak_activations) == max(one_f_one_b.peak_activations) == min(p, m)
    assert h1.peak_activations[0] == min(p, m)
    assert h1.makespan == time_order(zb_h1_order(p, m), m, stage_costs(None, p)).makespan
    # Rank 0 starts first and ends last, so both bubble definitions agree.
    assert h1.bubble_rate == pytest.approx(h1.sync_bubble_rate)
    if m >= p:
        # Bubble time (p-1)(T_F+T_B-T_W) = p-1: exactly a third of 1F1B's 3(p-1). As rates that is
        # (p-1)/(3m+p-1) against (p-1)/(m+p-1): a ratio (m+p-1)/(3m+p-1) between 1/3 and 1/2.
        assert h1.makespan == 3 * m + p - 1
        assert idle(h1) == pytest.approx(idle(one_f_one_b) / 3)
        ratio = h1.bubble_rate / one_f_one_b.bubble_rate
        assert ratio == pytest.approx((m + p - 1) / (3 * m + p - 1))
        assert 1 / 3 < ratio <= 0.5
    else:  # fewer micro-batches than ranks: less to defer, still never worse than 1F1B
        assert idle(h1) <= 2 / 3 * idle(one_f_one_b) + 1e-9


@pytest.mark.parametrize(("p", "m"), GRID)
def test_zb_h2(p: int, m: int) -> None:
    h2 = sim("zb-h2", p, m)
    assert max(h2.peak_activations) <= 2 * p
    assert h2.makespan <= sim("zb-h1", p, m).makespan
    if m >= 2 * p - 1:
        assert h2.bubble_rate < 0.01  # in fact 0 for these m
        # the global makespan still has the (p-1) T_F ramp of the last rank
        assert h2.sync_bubble_rate == pytest.approx((p - 1) / (3 * m + p - 1))


@pytest.mark.parametrize(("p", "m"), GRID)
def test_zb_auto_unit_costs(p: int, m: int) -> None:
    low, high = sim("zb-auto", p, m, UNIT, p), sim("zb-auto", p, m, UNIT, 2 * p)
    assert max(low.peak_activations) <= p
    assert max(high.peak_activations) <= 2 * p
    assert low.makespan <= sim("zb-h1", p, m).makespan + 1e-9
    assert high.makespan <= sim("zb-h2", p, m).makespan + 1e-9
    if m >= 2 * p:
        assert high.bubble_rate < 0.01


def test_zb_auto_default_limit_is_2p() -> None:
    schedule = generate("zb-auto", 4, 16)
    assert schedule.params["memory_limit"] == 8
    assert max(simulate(schedule).peak_activations) == 8


# ---- unequal costs -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("p", "m"), SMALL_GRID)
def test_zb_auto_unequal_costs(p: int, m: int) -> None:
    auto = sim("zb-auto", p, m, UNEQUAL, None)
    handcrafted = [simulate(generate(name, p, m), UNEQUAL) for name in ("zb-h1", "zb-h2")]
    assert auto.makespan <= min(r.makespan for r in handcrafted) + 1e-9
    assert max(auto.peak_activations) <= 2 * p
    with_p = sim("zb-auto", p, m, UNEQUAL, p)
    assert with_p.makespan <= handcrafted[0].makespan + 1e-9
    assert max(with_p.peak_activations) <= p


@pytest.mark.parametrize(("p", "m", "limit"), [(4, 8, 1), (4, 8, 2), (4, 8, 6), (4, 8, 6.5), (3, 20, 4), (5, 7, 100)])
def test_zb_auto_other_limits(p: int, m: int, limit: float) -> None:
    for costs in (UNIT, UNEQUAL):
        result = sim("zb-auto", p, m, costs, limit)
        assert max(result.peak_activations) <= limit


def test_zb_auto_memory_helps() -> None:
    # More memory does not hurt here, and helps overall.
    makespans = [sim("zb-auto", 4, 16, UNEQUAL, limit).makespan for limit in (1, 2, 4, 8)]
    assert makespans == sorted(makespans, reverse=True)
    assert makespans[0] > makespans[-1]


def test_variants_are_distinct() -> None:
    assert len({v.name for v in DEFAULT_VARIANTS}) == len(DEFAULT_VARIANTS)


# ---- property test -------------------------------------------------------------------------------------
cost_value = st.floats(0.0, 3.0, allow_nan=False).map(lambda x: round(x, 2))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    p=st.integers(1, 7),
    m=st.integers(1, 24),
    data=st.data(),
    limit=st.one_of(st.none(), st.integers(-1, 20), st.floats(-1.0, 20.0, allow_nan=False), st.just(math.inf)),
)
def test_zb_auto_valid_or_refused(p: int, m: int, data: st.DataObject, limit: float | None) -> None:
    per_stage = data.draw(st.booleans())

    def draw_cost() -> float | tuple[float, ...]:
        if per_stage:
            return tuple(data.draw(st.lists(cost_value, min_size=p, max_size=p)))
        return data.draw(cost_value)

    costs = Costs(draw_cost(), draw_cost(), draw_cost(), None, data.draw(st.floats(0.0, 0.5)))
    try:
        schedule = generate("zb-auto", p, m, costs=costs, memory_limit=limit)
    except ScheduleError as exc:
        assert limit is not None and limit < 1, exc
        return
    validate(schedule)
    result = simulate(schedule, costs)
    assert max(result.peak_activations) <= (2 * p if limit is None else limit)
    assert result.makespan == pytest.approx(schedule.params["makespan"], rel=1e-9, abs=1e-9)


# ---- command line --------------------------------------------------------------------------------------
def test_cli_picks_them_up(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert all(f"\n{name} " in out for name in ("zb-h1", "zb-h2", "zb-auto"))
    assert main(["simulate", "zb-auto", "-p", "4", "-m", "8", "--costs", "1,1.1,0.6,0.05", "--memory-limit", "1p"]) == 0
    out = capsys.readouterr().out
    assert "peak activation 4 stage units" in out
    assert main(["compare", "-p", "4", "-m", "8"]) == 0
    out = capsys.readouterr().out
    assert all(f"\n{name} " in out for name in ("zb-h1", "zb-h2", "zb-auto"))
    assert main(["simulate", "zb-h1", "-p", "4", "-m", "8", "--memory-limit", "2p"]) == 2
    assert "zb-auto" in capsys.readouterr().err
