"""Ranks that run different schedules: caught before the first iteration, never a silent wrong result."""

from __future__ import annotations

from functools import cache

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from megatron_pp_ext.analysis.schedule_check import validate
from megatron_pp_ext.schedules import Schedule, generate
from megatron_pp_ext.verification import criterion
from megatron_pp_ext.verification.compare import compare
from megatron_pp_ext.verification.rank_pool import VerifyRunError, check_errors
from megatron_pp_ext.verification.reference import reference_runs
from megatron_pp_ext.verification.run_spec import RunHooks, RunSpec
from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec

P, M = 2, 4
MODEL = TinyGPTSpec(num_layers=4)  # 2 layers per stage (loop placements) or 1 (V / interleaved)


def _swapped(schedule: Schedule, rank: int, index: int) -> Schedule | None:
    """``schedule`` with ops ``index`` and ``index + 1`` of ``rank`` swapped, if still valid."""
    rows = [list(row) for row in schedule.ops]
    rows[rank][index], rows[rank][index + 1] = rows[rank][index + 1], rows[rank][index]
    out = Schedule(schedule.placement, schedule.num_microbatches, tuple(map(tuple, rows)), f"{schedule.name}~r{rank}")
    try:
        validate(out)
    except Exception:
        return None
    return out


@cache
def candidates() -> tuple[str, ...]:
    """CSV of every schedule a rank may run: generated ones and valid one-swap variants of two of them."""
    out = [generate(name, P, M).to_csv() for name in ("1f1b", "gpipe", "zb-h1", "v-half", "v-min", "interleaved-1f1b")]
    for base in (generate("gpipe", P, M), generate("1f1b", P, M)):
        for rank in range(P):
            for index in range(len(base.ops[rank]) - 1):
                variant = _swapped(base, rank, index)
                if variant is not None:
                    out.append(variant.to_csv())
    return tuple(out)


def _spec(csv0: str, csv1: str, check_agreement: bool = True, **kw) -> RunSpec:
    return RunSpec(
        pp=P,
        num_microbatches=M,
        schedule_csv=csv0,
        hooks=RunHooks(schedule_csv_overrides=((1, csv1),), check_agreement=check_agreement),
        model=MODEL,
        iterations=2,
        timeout_s=10.0,
        split_backward=True,
        adam_eps=criterion.ADAM_EPS,
        lr=criterion.LR,
        **kw,
    )


def _run(pool, csv0: str, csv1: str, **kw) -> list:
    # a guard against a hang only (the verdicts are the errors' texts): well above the 10 s p2p timeout
    return pool.run(_spec(csv0, csv1, **kw), wall_timeout_s=180)


_REFERENCE: list = []


def _reference(pool) -> tuple[list, list]:
    """(exact, megatron fp32) references of every run here (same model, data and training)."""
    if not _REFERENCE:
        csv = generate("gpipe", P, M).to_csv()
        _REFERENCE.append(reference_runs(pool, _spec(csv, csv)))
    return _REFERENCE[0]


def test_v_half_against_v_min_fails_at_once_naming_ranks_and_parts(pool):
    _reference(pool)  # warm-up: the pool's workers import torch and megatron once
    results = _run(pool, generate("v-half", P, M).to_csv(), generate("v-min", P, M).to_csv())
    errors = [r["error"] for r in results if "error" in r]
    assert len(errors) == P, errors  # every rank stops, none hangs
    for message in errors:
        assert "ScheduleMismatchError" in message
        assert "disagree on the pipeline schedule" in message
        assert "name/params" in message and "ops of ranks 0, 1" in message
        assert "rank 0: 'v-half'" in message and "rank 1: 'v-min'" in message
        assert "\n" not in message


def test_rows_differing_only_in_one_ranks_backward_order_are_named(pool):
    base = generate("gpipe", P, M)
    variant = _swapped(base, 1, M)  # BW1.0 <-> BW1.1 on rank 1
    assert variant is not None
    results = _run(pool, base.to_csv(), variant.to_csv().replace(variant.name, base.name))
    errors = [r["error"] for r in results if "error" in r]
    assert len(errors) == P, errors
    assert all("ops of rank 1 differ" in e for e in errors), errors


def test_crossed_message_is_caught_where_it_lands_with_check_messages(pool):
    """Without the agreement (switched off here), --pipeline-check-messages still catches the swap."""
    base = generate("gpipe", P, M)
    variant = _swapped(base, 1, M)
    assert variant is not None
    results = _run(pool, base.to_csv(), variant.to_csv(), check_agreement=False, check_messages=True)
    errors = [r["error"] for r in results if "error" in r]
    assert any("crossed message" in e and "grad[1->0 mb0" in e for e in errors), errors


def test_same_schedule_with_check_messages_matches_reference(pool):
    csv = generate("v-half", P, M).to_csv()
    results = _run(pool, csv, csv, check_messages=True)
    check_errors(results)
    exact, reference = _reference(pool)
    report = compare("v-half", P, M, 2, reference, results, exact=exact)
    assert report.ok, report


CANDIDATES = candidates()
GPIPE_BW_SWAP = CANDIDATES.index(_swapped(generate("gpipe", P, M), 1, M).to_csv())  # type: ignore[union-attr]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    first=st.integers(0, len(CANDIDATES) - 1),
    second=st.one_of(st.none(), st.integers(0, len(CANDIDATES) - 1)),  # None: the same schedule
)
@example(first=3, second=4)  # v-half on rank 0, v-min on rank 1 (trained silently wrong before the agreement)
@example(first=1, second=GPIPE_BW_SWAP)  # rows differing only in rank 1's BW order (same)
@example(first=3, second=None)
def test_any_pair_of_schedules_trains_like_the_reference_or_fails_fast(pool, first, second):
    exact, reference = _reference(pool)
    csv0 = CANDIDATES[first]
    csv1 = csv0 if second is None else CANDIDATES[second]
    results = _run(pool, csv0, csv1)
    try:
        check_errors(results)
    except VerifyRunError as exc:
        assert csv0 != csv1
        assert "did not complete within" not in str(exc)  # stopped by the agreement or a checked message, not a wait
        return
    report = compare("pair", P, M, 0, reference, results, exact=exact)
    assert report.ok, (report, csv0, csv1)


@pytest.mark.parametrize("value", ["abc", "0", "-1", "nan", "inf"])
def test_bad_p2p_timeout_env_names_the_variable(monkeypatch, value):
    from megatron_pp_ext.runtime import p2p

    monkeypatch.setenv("MEGATRON_PP_P2P_TIMEOUT", value)
    with pytest.raises(ValueError, match=r"MEGATRON_PP_P2P_TIMEOUT=.*expected a number of seconds > 0"):
        p2p.timeout_from_env()


def test_ranks_that_disagree_after_a_replan_stop_there(pool):
    """The agreement runs again after every re-plan: rank 1 re-plans to zb-h1, the others to zb-auto."""
    p, m = 2, 4
    spec = RunSpec(
        pp=p,
        num_microbatches=m,
        model=TinyGPTSpec(num_layers=p),
        iterations=3,
        split_backward=True,
        replan_schedule="zb-auto",
        replan_initial_costs="1,1,6,0",
        profile_iterations=1,
        hooks=RunHooks(replan_overrides=((1, "zb-h1"),)),
        timeout_s=10.0,
    )
    results = pool.run(spec, wall_timeout_s=90)
    errors = [r["error"] for r in results if "error" in r]
    assert len(errors) == p, errors
    assert all("disagree on the pipeline schedule" in e and "rank 1: 'zb-h1'" in e for e in errors), errors
