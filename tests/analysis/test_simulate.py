"""simulate(): closed forms, communication cost, memory, and properties over random costs."""

from __future__ import annotations

import itertools
import json
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pp_ext.analysis import DEFAULT_W_RETAINED_FRACTION, DeadlockError, SimResult, simulate
from megatron_pp_ext.schedules import (
    B,
    F,
    Schedule,
    W,
    build_schedule,
    generate,
    loop_placement,
    lower,
    v_placement,
)
from megatron_pp_ext.schedules.costs import Costs

from .helpers import naive_lowering, random_serial_schedule, reference_times

DATA = Path(__file__).parent / "data"
JSON_KEYS = {
    "schedule",
    "p",
    "m",
    "v",
    "makespan",
    "bubble_rate",
    "sync_bubble_rate",
    "bubble_rate_per_rank",
    "sync_bubble_rate_per_rank",
    "peak_activations",
    "peak_activations_1f1b_units",
    "peak_activation_bytes",
    "p2p_messages",
    "local_handoffs",
}


def sim(schedule: Schedule, costs: Costs | None = None, **kwargs: object) -> SimResult:
    return simulate(schedule, costs, lowered=lower(schedule), **kwargs)  # type: ignore[arg-type]


# ---- closed forms (unit costs, no communication cost) -----------------------------------------
@pytest.mark.parametrize("p", range(2, 17))
def test_gpipe_1f1b_bubble_and_memory(p: int) -> None:
    for m in range(1, 4 * p + 1):
        bubble = (p - 1) / (m + p - 1)
        for name, peak in (("gpipe", [m] * p), ("1f1b", [min(p - r, m) for r in range(p)])):
            result = sim(generate(name, p, m))
            assert result.bubble_rate == pytest.approx(bubble, rel=1e-9), (name, m)
            assert result.sync_bubble_rate == pytest.approx(bubble, rel=1e-9), (name, m)
            assert result.makespan == pytest.approx(3 * (m + p - 1), rel=1e-12)
            assert result.peak_activations == peak, (name, m)
            assert result.peak_activations_1f1b_units == peak
            assert result.p2p_messages == result.p2p_volume == 2 * (p - 1) * m
            assert result.local_handoffs == 0
            assert result.busy == [3.0 * m] * p


def test_default_costs_are_unit_and_validation_runs() -> None:
    schedule = generate("1f1b", 4, 6)
    result = simulate(schedule)  # validates and lowers by itself
    assert result.makespan == sim(schedule, Costs.unit()).makespan == 27.0
    assert Costs() == Costs.unit() == Costs(1, 1, 1, None, 0)


# ---- communication cost ---------------------------------------------------------------------
@pytest.mark.parametrize("p", [2, 3, 5, 8])
@pytest.mark.parametrize("comm", [0.1, 0.5, 2.0])
def test_comm_cost_gpipe(p: int, comm: float) -> None:
    """Every micro-batch crosses 2(p-1) hops on the critical path, paid once: the pipeline streams."""
    for m in (1, 2, p, 2 * p + 1):
        result = sim(generate("gpipe", p, m), Costs(1.0, 1.0, 1.0, None, comm))
        assert result.makespan == pytest.approx((m + p - 1) * 3.0 + 2 * (p - 1) * comm, rel=1e-12)


@pytest.mark.parametrize("p", [2, 3, 5, 8])
@pytest.mark.parametrize("comm", [0.1, 0.5, 2.0])
def test_comm_cost_1f1b_short(p: int, comm: float) -> None:
    """1F1B with m <= 2: makespan = (m+p-1)(t_f+t_bw) + 2(p-1) t_comm."""
    t_f, t_b, t_w = 1.0, 1.5, 0.5
    for m in (1, 2):
        result = sim(generate("1f1b", p, m), Costs(t_f, t_b, t_w, None, comm))
        assert result.makespan == pytest.approx((m + p - 1) * (t_f + t_b + t_w) + 2 * (p - 1) * comm, rel=1e-12)


def test_comm_cost_1f1b_steady_state_stalls() -> None:
    """With m > 2 the 1F1B steady state waits for round trips: the simple formula is a lower bound.

    p=2, m=3, T_F=1, T_BW=2, comm c, by hand: rank 1 runs F1.0 [1+c, 2+c], BW1.0 [2+c, 4+c],
    F1.1 [4+c, 5+c], BW1.1 [5+c, 7+c]; rank 0 runs F0.0, F0.1, BW0.0 [4+2c, 6+2c], F0.2 [6+2c, 7+2c],
    BW0.1 [7+2c, 9+2c]; rank 1: F1.2 [7+3c, 8+3c], BW1.2 [8+3c, 10+3c]; rank 0: BW0.2 [10+4c, 12+4c].
    """
    c = 0.5
    result = sim(generate("1f1b", 2, 3), Costs(1.0, 1.0, 1.0, None, c))
    assert result.makespan == pytest.approx(12 + 4 * c)
    assert result.timeline[2] == (0, "BW0.0", 4 + 2 * c, 6 + 2 * c)
    for p, m in ((3, 7), (4, 9), (6, 20)):
        simple = (m + p - 1) * 3.0 + 2 * (p - 1) * c
        assert sim(generate("1f1b", p, m), Costs(1, 1, 1, None, c)).makespan > simple


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(["gpipe", "1f1b"]),
    p=st.integers(1, 6),
    m=st.integers(1, 10),
    comm=st.floats(0.0, 3.0),
    seed=st.integers(0, 2**32 - 1),
)
def test_baselines_match_reference_model(name: str, p: int, m: int, comm: float, seed: int) -> None:
    """GPipe and 1F1B need no early receive: the lowered timing equals the data-dependency timing."""
    rng = random.Random(seed)
    t_f, t_b, t_w = ([rng.uniform(0.1, 3.0) for _ in range(p)] for _ in range(3))
    schedule = generate(name, p, m)
    result = sim(schedule, Costs(tuple(t_f), tuple(t_b), tuple(t_w), None, comm))
    t_bw = [b + w for b, w in zip(t_b, t_w, strict=True)]
    expected = reference_times(schedule, t_f, t_b, t_w, t_bw, comm)
    got = [[(s, e) for r, _, s, e in result.timeline if r == rank] for rank in range(p)]
    for rank in range(p):
        flat_got = [t for pair in got[rank] for t in pair]  # approx compares flat sequences only
        flat_expected = [t for pair in expected[rank] for t in pair]
        assert flat_got == pytest.approx(flat_expected, rel=1e-12, abs=1e-12)


# ---- memory -----------------------------------------------------------------------------------
def split_single_rank() -> Schedule:
    ops = [F(0, 0), B(0, 0), F(0, 1), W(0, 0), B(0, 1), W(0, 1)]
    return build_schedule("split", loop_placement(1), 2, [ops])


@pytest.mark.parametrize(("fraction", "peak"), [(1.0, 2.0), (0.9, 1.9), (0.5, 1.5), (0.0, 1.0)])
def test_w_retained_fraction(fraction: float, peak: float) -> None:
    """F0.0 (+1), B0.0 frees 1-f, F0.1 (+1) is the peak: 2 - (1 - f)."""
    result = sim(split_single_rank(), w_retained_fraction=fraction, activation_bytes=100.0)
    assert result.peak_activations == [pytest.approx(peak)]
    assert result.peak_activation_bytes == [pytest.approx(100.0 * peak)]


def test_default_fraction_counts_until_w() -> None:
    assert DEFAULT_W_RETAINED_FRACTION == 1.0
    assert sim(split_single_rank()).peak_activations == [2.0]
    assert sim(split_single_rank()).peak_activation_bytes is None
    with pytest.raises(ValueError, match="w_retained_fraction"):
        sim(split_single_rank(), w_retained_fraction=1.5)


def test_activation_bytes_per_stage() -> None:
    schedule = generate("gpipe", 2, 3)
    result = sim(schedule, activation_bytes=(100.0, 300.0))
    assert result.peak_activation_bytes == [300.0, 900.0]
    assert result.peak_activations == [3.0, 3.0]
    with pytest.raises(ValueError, match="activation_bytes lists 3 per-stage values"):
        sim(schedule, activation_bytes=(1.0, 2.0, 3.0))


def test_v_placement_units() -> None:
    schedule = Schedule.load(DATA / "good_split_v.csv")
    result = sim(schedule)
    assert result.v == 2
    # rank 0 holds F0.0, F0.1, F3.0 (+ F3.1 after B3.0 with the default fraction 1.0 keeps B3.0's)
    assert result.peak_activations == [4.0, 4.0]
    assert result.peak_activations_1f1b_units == [2.0, 2.0]  # a V stage is half a 1F1B stage
    assert result.local_handoffs == 4


def test_message_bytes_volume() -> None:
    schedule = generate("1f1b", 3, 4)
    result = sim(schedule, message_bytes=(10.0, 20.0, 30.0))
    # boundary 0|1 carries act + grad per micro-batch, boundary 1|2 too
    assert result.p2p_volume == pytest.approx(4 * 2 * (10.0 + 20.0))
    assert sim(schedule, message_bytes=8.0).p2p_volume == 8.0 * result.p2p_messages


# ---- properties -------------------------------------------------------------------------------
cost_value = st.floats(0.05, 5.0)


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    p=st.integers(1, 4),
    m=st.integers(1, 5),
    style=st.sampled_from(["loop1", "loop2", "v"]),
    split=st.booleans(),
    t_f=cost_value,
    t_b=cost_value,
    t_w=cost_value,
    t_bw=st.one_of(st.none(), cost_value),
    comm=st.floats(0.0, 2.0),
)
def test_properties_random_schedules(
    seed: int,
    p: int,
    m: int,
    style: str,
    split: bool,
    t_f: float,
    t_b: float,
    t_w: float,
    t_bw: float | None,
    comm: float,
) -> None:
    placement = v_placement(p) if style == "v" else loop_placement(p, int(style[-1]))
    schedule = random_serial_schedule(random.Random(seed), placement, m, split)
    costs = Costs(t_f, t_b, t_w, t_bw, comm)
    result = simulate(schedule, costs)
    assert result.makespan >= max(result.busy) - 1e-9
    assert 0.0 <= result.bubble_rate < 1.0
    assert 0.0 <= result.sync_bubble_rate < 1.0
    assert result.bubble_rate <= result.sync_bubble_rate + 1e-12
    assert all(0.0 <= x < 1.0 for x in result.bubble_rate_per_rank + result.sync_bubble_rate_per_rank)
    assert result.idle == pytest.approx([result.makespan - b for b in result.busy])
    backward = t_b + t_w if t_bw is None else t_bw
    per_op = {"F": t_f, "B": t_b, "W": t_w, "BW": backward}
    for rank in range(p):
        rows = [(op, s, e) for r, op, s, e in result.timeline if r == rank]
        assert [op for op, _, _ in rows] == [str(op) for op in schedule.ops[rank]]
        assert all(e - s == pytest.approx(per_op[op.rstrip("0123456789.")]) for op, s, e in rows)
        assert all(e1 <= s2 + 1e-12 for (_, _, e1), (_, s2, _) in itertools.pairwise(rows))
        assert result.busy[rank] == pytest.approx(sum(e - s for _, s, e in rows))
    # the receives of the naive lowering sit right before their consumers: the data-dependency timing
    t = [float(t_f)] * schedule.num_stages
    expected = reference_times(schedule, t, [t_b] * len(t), [t_w] * len(t), [backward] * len(t), comm)
    naive = simulate(schedule, costs, lowered=naive_lowering(schedule))
    for rank in range(p):
        got = [(s, e) for r, _, s, e in naive.timeline if r == rank]
        flat_got = [t for pair in got for t in pair]  # approx compares flat sequences only
        assert flat_got == pytest.approx([t for pair in expected[rank] for t in pair], rel=1e-9, abs=1e-9)
    # moving receives earlier (the real lowering) can only delay
    assert result.makespan >= naive.makespan - 1e-9


def test_data_cycle_stops_the_simulation() -> None:
    schedule = Schedule.load(DATA / "deadlock_cycle.csv")
    with pytest.raises(DeadlockError, match="simulation stuck"):
        simulate(schedule, lowered=naive_lowering(schedule))
    with pytest.raises(DeadlockError, match="wait cycle"):
        simulate(schedule)


# ---- result and costs API ---------------------------------------------------------------------
def test_json_dict() -> None:
    result = sim(generate("1f1b", 4, 8), Costs(1.0, 1.0, 1.0, None, 1 / 3))
    data = result.to_json_dict()
    assert set(data) == JSON_KEYS
    json.dumps(data)
    assert data["schedule"] == "1f1b" and (data["p"], data["m"], data["v"]) == (4, 8, 1)
    assert data["makespan"] == round(result.makespan, 6)
    assert all(len(str(x).split(".")[-1]) <= 6 for x in data["bubble_rate_per_rank"])  # type: ignore[union-attr]
    with_timeline = result.to_json_dict(include_timeline=True)
    assert set(with_timeline) == JSON_KEYS | {"timeline"}
    assert with_timeline["timeline"][0] == [0, "F0.0", 0.0, 1.0]  # type: ignore[index]
    assert len(with_timeline["timeline"]) == 4 * 16  # type: ignore[arg-type]


def test_span_and_per_rank_rates() -> None:
    result = sim(generate("1f1b", 3, 2))
    # rank 2 starts at 2, its span is F, BW, F, BW back to back = 6 with no gaps
    assert result.span[2] == 6.0 and result.bubble_rate_per_rank[2] == 0.0
    assert result.sync_bubble_rate_per_rank[2] == pytest.approx((result.makespan - 6.0) / result.makespan)
    assert result.span[0] == result.makespan


def test_costs_parse() -> None:
    assert Costs.parse("1,2,3") == Costs(1.0, 2.0, 3.0, None, 0.0)
    assert Costs.parse(" 1, 2 ,3, 0.25") == Costs(1.0, 2.0, 3.0, None, 0.25)
    assert Costs.unit() == Costs.parse("1,1,1,0")
    for bad in ("", "1,2", "1,2,3,4,5", "a,b,c", "1,-1,1", "1,1,nan", "1,1,1,inf"):
        with pytest.raises(ValueError, match=r"costs|cost"):
            Costs.parse(bad)


def test_costs_per_stage() -> None:
    costs = Costs((1.0, 2.0), 1.0, (0.5, 0.5))
    assert costs.per_stage(2) == ([1.0, 2.0], [1.0, 1.0], [0.5, 0.5], [1.5, 1.5])
    assert Costs(1, 1, 1, 5).per_stage(1)[3] == [5.0]
    with pytest.raises(ValueError, match="t_f lists 2 per-stage values, the schedule has 3 stages"):
        costs.per_stage(3)
    with pytest.raises(ValueError, match="t_comm"):
        Costs(t_comm=(1.0,))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="t_b"):
        Costs(t_b=-1.0)
    with pytest.raises(ValueError, match="the schedule has 3 stages"):
        sim(generate("1f1b", 3, 2), Costs((1.0, 2.0), 1, 1))


def test_prefetched_receive_buffers_count_in_the_byte_peak() -> None:
    """With ``message_bytes`` the byte peak holds the receive buffers posted ahead of their consumer
    (``CommPlan.receive_buffers``), as the tracer counts them; without it, activations only."""
    from megatron_pp_ext.schedules import generate, lower

    schedule = generate("zb-h2", 2, 4)
    plan = lower(schedule).plan
    assert plan is not None
    alone = simulate(schedule, activation_bytes=0.0).peak_activation_bytes
    with_buffers = simulate(schedule, activation_bytes=0.0, message_bytes=10.0).peak_activation_bytes
    assert alone == [0.0, 0.0]
    assert with_buffers == [10.0 * max(len(mids) for mids in row) for row in plan.receive_buffers]
    assert max(with_buffers) > 0
