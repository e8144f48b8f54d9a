"""ZeroPP (``zeropp``): scheduling units, blockwise order, overlapping units, FSDP gathers, adaptive U.

Unit costs (T_F = T_B = T_W = 1 per looped stage, no communication) unless a test says otherwise;
peak activations in the schedule's stage units (``v`` of them make one 1F1B activation M_a).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pp_ext.analysis.schedule_check import validate
from megatron_pp_ext.analysis.simulate import simulate
from megatron_pp_ext.analysis.zeropp_auto import choose_unit_size
from megatron_pp_ext.schedules import OpKind, generate, names
from megatron_pp_ext.schedules.collectives import (
    CollectiveKind,
    check_collectives,
    declared_fsdp_limit,
    derive_collectives,
    policy_for,
)
from megatron_pp_ext.schedules.costs import Costs
from megatron_pp_ext.schedules.generators.common import ScheduleParameterError
from megatron_pp_ext.schedules.generators.zeropp import unit_ranges, zeropp
from megatron_pp_ext.schedules.schedule import Schedule


def unit_sizes(p: int, m: int) -> list[int]:
    return sorted(u for u in {1, 2, 3, p, max(1, m // 2), m} if u <= m)


GRID = [
    (p, m, v, u)
    for p in (1, 2, 3, 4, 5, 8)
    for m in sorted({1, 2, max(1, p - 1), p, p + 1, 2 * p + 1, 3 * p})
    for v in (1, 2, 3, 4)
    for u in unit_sizes(p, m)
]


def fsdp_gathers(schedule: Schedule) -> list[int]:
    plan = derive_collectives(schedule, policy_for(schedule, fsdp=True))
    check_collectives(plan)
    return [plan.count(CollectiveKind.UNSHARD, r) for r in range(schedule.num_ranks)]


def claimed_gathers(p: int, m: int, v: int, unit: int) -> tuple[int, int]:
    """(min, max) FSDP gathers per rank per iteration that docs/zeropp.md claims (limit 2 gathered chunks):
    v <= 2 keeps every chunk gathered (v); otherwise at most 2 v per unit, exactly 2 v - 2 for one unit."""
    if v <= 2:
        return v, v
    if unit == m:
        return 2 * v - 2, 2 * v - 2
    return 2 * v - 2, 2 * v * len(unit_ranges(m, unit))


def check_blockwise(schedule: Schedule, unit: int) -> None:
    """Inside each unit a rank's forwards go chunk 0 first, its backwards chunk v-1 first (breadth-first)."""
    p, m = schedule.num_ranks, schedule.num_microbatches
    for r, ops in enumerate(schedule.ops):
        for mbs in unit_ranges(m, unit):
            fwd = [(op.stage // p, op.microbatch) for op in ops if op.kind == OpKind.F and op.microbatch in mbs]
            bwd = [(-(op.stage // p), op.microbatch) for op in ops if op.kind == OpKind.B and op.microbatch in mbs]
            assert fwd == sorted(fwd), (r, mbs, fwd)
            assert bwd == sorted(bwd), (r, mbs, bwd)


def test_registered() -> None:
    assert "zeropp" in names()
    schedule = generate("zeropp", 4, 8)
    assert schedule.chunks_per_rank == 2 and schedule.params["unit_size"] == 8  # defaults: v = 2, U = m
    assert schedule.splits_backward
    assert declared_fsdp_limit(schedule) == 2
    assert declared_fsdp_limit(generate("zeropp", 4, 8, v=1)) == 1


@pytest.mark.slow
def test_valid_deadlock_free_blockwise_and_fsdp_over_the_grid() -> None:
    # includes U = 1, U = m, m < p and m % U != 0 (the last unit takes the remainder)
    bad = []
    for p, m, v, u in GRID:
        schedule = generate("zeropp", p, m, v=v, unit_size=u)
        validate(schedule)  # placement, completeness (one F, B, W each), dependencies, deadlock freedom
        check_blockwise(schedule, u)
        low, high = claimed_gathers(p, m, v, u)
        gathers = fsdp_gathers(schedule)  # check_collectives inside
        if not all(low <= g <= high for g in gathers):
            bad.append((p, m, v, u, gathers, (low, high)))
    assert not bad, bad


def test_remainder_unit() -> None:
    assert [list(r) for r in unit_ranges(7, 3)] == [[0, 1, 2], [3, 4, 5], [6]]
    schedule = generate("zeropp", 4, 7, v=2, unit_size=3)
    validate(schedule)
    check_blockwise(schedule, 3)


def test_consecutive_units_overlap_and_w_fills_gaps() -> None:
    # unit k+1's first forward comes before unit k's last backward on every rank but the last, whose
    # backwards follow its forwards without a gap (not bfs's sequential groups)
    p, m, v, u = 4, 8, 2, 4
    schedule = generate("zeropp", p, m, v=v, unit_size=u)
    for ops in schedule.ops[:-1]:
        kinds = [(op.kind, op.microbatch // u) for op in ops]
        first_f_unit1 = kinds.index((OpKind.F, 1))
        last_b_unit0 = max(i for i, k in enumerate(kinds) if k == (OpKind.B, 0))
        assert first_f_unit1 < last_b_unit0
    # W passes are staggered: some W runs before the rank's last F or B
    for ops in schedule.ops:
        last_fb = max(i for i, op in enumerate(ops) if op.kind != OpKind.W)
        assert any(op.kind == OpKind.W for op in ops[:last_fb])


def test_bubble_beats_1f1b_and_bfs_zb_with_unit_costs() -> None:
    for p, m in ((4, 8), (8, 16)):
        zp = simulate(generate("zeropp", p, m, v=2, unit_size=p), Costs.unit()).sync_bubble_rate
        assert zp <= simulate(generate("bfs-zb", p, m, v=2), Costs.unit()).sync_bubble_rate
        assert zp < simulate(generate("1f1b", p, m), Costs.unit()).sync_bubble_rate


def test_unit_size_trades_gathers_and_memory() -> None:
    p, m, v = 8, 32, 4
    gathers = {u: max(fsdp_gathers(generate("zeropp", p, m, v=v, unit_size=u))) for u in (1, 4, 8, 32)}
    peaks = {u: max(simulate(generate("zeropp", p, m, v=v, unit_size=u)).peak_activations) for u in (1, 8, 32)}
    assert gathers[32] < gathers[8] < gathers[4] < gathers[1]
    assert peaks[1] < peaks[8] < peaks[32]


def test_simulator_counts_the_same_gathers() -> None:
    schedule = generate("zeropp", 4, 8, v=4, unit_size=2)
    result = simulate(schedule, collectives=policy_for(schedule, fsdp=True), dp=2, dp_bandwidth=1e6, param_bytes=1e6)
    assert result.data_parallel is not None
    assert [result.data_parallel.gathers(r) for r in range(4)] == fsdp_gathers(schedule)


@settings(max_examples=40, deadline=None)
@given(
    p=st.integers(1, 6),
    m=st.integers(1, 14),
    v=st.integers(1, 4),
    unit=st.integers(1, 14),
    costs=st.tuples(st.floats(0.5, 2), st.floats(0.5, 2), st.floats(0.2, 2), st.sampled_from([0.0, 0.1])),
)
def test_property_any_costs_valid(p: int, m: int, v: int, unit: int, costs: tuple[float, ...]) -> None:
    unit = min(unit, m)
    f, b, w, comm = costs
    schedule = generate("zeropp", p, m, v=v, unit_size=unit, costs=Costs(f, b, w, None, comm))
    validate(schedule)
    check_blockwise(schedule, unit)
    low, high = claimed_gathers(p, m, v, unit)
    assert all(low <= g <= high for g in fsdp_gathers(schedule))


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"unit_size": 0}, "unit_size (--pipeline-unit-size, micro-batches per scheduling unit) must be an integer in"),
        ({"unit_size": 9}, "1..m = 1..8"),
        ({"unit_size": 2.5}, "unit_size"),
        ({"unit_size": "big"}, "unit_size"),
        ({"unit_size": True}, "unit_size"),
        ({"v": 0}, "v must be >= 1"),  # the declared capabilities check v before the generator
        (
            {"memory_limit": 0.5, "unit_size": 2},
            "zeropp needs memory_limit >= 1 M_a",  # the declared template, as for zb-auto and v-zb
        ),
        ({"microbatch_group_size": 2}, "does not take parameter(s) microbatch_group_size"),
    ],
)
def test_bad_input(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ScheduleParameterError) as info:
        generate("zeropp", 4, 8, **kwargs)
    assert needle in str(info.value)


def test_auto_picks_the_fastest_that_fits_and_lists_the_alternatives() -> None:
    costs = Costs(1.0, 1.0, 1.0, None, 0.05)
    fsdp = {"dp": 4, "dp_bandwidth": 25e6, "param_bytes": 1e8, "fsdp": True, "activation_bytes": 1e8}
    choice = choose_unit_size(4, 8, v=4, costs=costs, **fsdp)  # type: ignore[arg-type]
    assert [c.unit_size for c in choice.candidates] == [1, 2, 4, 8]
    assert choice.best.iteration_time == min(c.iteration_time for c in choice.candidates)
    assert choice.schedule.params["unit_size"] == choice.best.unit_size
    assert "<- chosen" in choice.table()
    # a budget that only the smaller units meet
    limit = min(c.peak_activations for c in choice.candidates)
    tight = choose_unit_size(4, 8, v=4, costs=costs, memory_limit=limit)
    assert tight.best.peak_activations <= limit and all(
        c.fits == (c.peak_activations <= limit) for c in tight.candidates
    )
    with pytest.raises(ScheduleParameterError, match="--pipeline-memory-limit"):
        choose_unit_size(4, 8, v=4, costs=costs, memory_limit=0.5)
    # by name through the registry (the chooser analysis registers), as the CLI and --pipeline-unit-size
    # auto ask for it; the generator itself takes a number
    assert generate("zeropp", 4, 8, unit_size="auto").params["unit_size_auto"] is True
    with pytest.raises(ScheduleParameterError, match="chosen with the simulator"):
        zeropp(4, 8, unit_size="auto")


@pytest.mark.parametrize("t_w", [0.5, 1.0, 3.0])
def test_w_never_delays_a_forward_or_backward(t_w: float) -> None:
    # with two units (never more than window + 1 open) no W is forced: every W sits in a gap it fits whole,
    # so an F or B right after a W starts exactly when its input arrives
    p, m, v, u = 4, 8, 2, 4
    costs = Costs(1.0, 1.0, t_w, None, 0.25)
    schedule = generate("zeropp", p, m, v=v, unit_size=u, costs=costs)
    result = simulate(schedule, costs)
    end = {
        op: start + {OpKind.F: 1.0, OpKind.B: 1.0, OpKind.W: t_w}[op.kind]
        for ops, starts in zip(result.ops, result.starts, strict=True)
        for op, start in zip(ops, starts, strict=True)
    }
    last = v * p - 1
    for r, (ops, starts) in enumerate(zip(result.ops, result.starts, strict=True)):
        for i in range(1, len(ops)):
            op = ops[i]
            if ops[i - 1].kind != OpKind.W or op.kind == OpKind.W:
                continue
            s, mb = op.stage, op.microbatch
            if op.kind == OpKind.F:
                producer = (
                    None
                    if s == 0
                    else next(o for o in end if o.kind == OpKind.F and o.stage == s - 1 and o.microbatch == mb)
                )
            else:
                kind, stage = (OpKind.F, s) if s == last else (OpKind.B, s + 1)
                producer = next(o for o in end if o.kind == kind and o.stage == stage and o.microbatch == mb)
            arrival = 0.0 if producer is None else end[producer] + (0.0 if producer.stage % p == r else 0.25)
            assert starts[i] == pytest.approx(max(arrival, starts[i - 1] + t_w)), (r, str(op))
            assert starts[i - 1] + t_w <= arrival + 1e-9, f"rank {r}: {ops[i - 1]} delayed {op}"


@pytest.mark.slow
def test_memory_limit_caps_live_activations_without_deadlock() -> None:
    # a micro-batch reserves its v activations at its first forward; a unit of U needs U M_a
    bad = []
    for p in (1, 2, 3, 4, 5, 8):
        for m in sorted({1, 2, p, p + 1, 2 * p + 1}):
            for v in (1, 2, 3):
                for u in sorted({1, 2, p, m}):
                    for limit in sorted({u, u + 0.5, p, 2 * p}):
                        if u > m or limit < u:
                            continue
                        schedule = generate("zeropp", p, m, v=v, unit_size=u, memory_limit=limit)
                        peak = max(simulate(schedule, lowered=validate(schedule)).peak_activations) / v
                        if peak > limit + 1e-9:
                            bad.append((p, m, v, u, limit, peak))
    assert not bad, bad
    # at 1F1B's memory (p M_a) the bubble still beats 1F1B's
    capped = simulate(generate("zeropp", 4, 16, v=2, unit_size=2, memory_limit=4))
    one_f_one_b = simulate(generate("1f1b", 4, 16))
    assert max(capped.peak_activations) / 2 <= max(one_f_one_b.peak_activations)
    assert capped.sync_bubble_rate < one_f_one_b.sync_bubble_rate


def test_memory_limit_below_the_unit_is_refused() -> None:
    with pytest.raises(ScheduleParameterError, match=r"needs memory_limit >= unit_size M_a.*--pipeline-unit-size <= 3"):
        generate("zeropp", 4, 8, unit_size=4, memory_limit=3.5)


def test_auto_skips_units_the_budget_cannot_hold() -> None:
    choice = choose_unit_size(4, 8, v=2, memory_limit=2.5)
    assert choice.skipped == (4, 8) and [c.unit_size for c in choice.candidates] == [1, 2]
    assert "skipped U = 4, 8" in choice.table()


def test_cli_unit_size(capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_pp_ext.cli import main

    argv = ["simulate", "zeropp", "-p", "4", "-m", "8", "-v", "4", "--costs", "1,1,1,0.05"]
    dp = ["--dp", "2", "--dp-bandwidth", "25", "--param-bytes", "2G", "--fsdp"]
    assert main([*argv, "--pipeline-unit-size", "auto", *dp]) == 0
    out, err = capsys.readouterr()
    assert "<- chosen" in err and "zeropp: chose --pipeline-unit-size" in err and "FSDP with 2 gathered" in out
    assert main([*argv, "--pipeline-unit-size", "9"]) == 2
    assert "1..m = 1..8" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*argv, "--pipeline-unit-size", "0"])


def test_memory_limit_without_a_unit_size_takes_the_largest_unit_it_holds() -> None:
    assert generate("zeropp", 4, 8, memory_limit=4.5).params["unit_size"] == 4
    assert generate("zeropp", 4, 8, memory_limit=20).params["unit_size"] == 8
