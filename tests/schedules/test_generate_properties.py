"""Property tests: for any input, a generator returns a valid schedule or raises a ScheduleError."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_pp_ext.analysis.schedule_check import validate
from megatron_pp_ext.schedules import Schedule, ScheduleError, generate, names
from megatron_pp_ext.schedules.generators.baselines import interleaved_warmup

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _generate_or_error(name: str, p: object, m: object, **kwargs: object) -> Schedule | None:
    try:
        schedule = generate(name, p, m, **kwargs)  # type: ignore[arg-type]
    except ScheduleError:
        return None  # a ValueError naming the problem; anything else fails the test
    assert isinstance(schedule, Schedule)
    validate(schedule)
    return schedule


@SETTINGS
@given(
    name=st.sampled_from(names()),
    p=st.integers(1, 10),
    m=st.integers(1, 32),
    v=st.one_of(st.none(), st.integers(1, 5)),
)
def test_any_registered_schedule_is_valid_or_refused(name: str, p: int, m: int, v: int | None) -> None:
    schedule = _generate_or_error(name, p, m, v=v)
    if schedule is not None:
        assert schedule.num_ranks == p
        assert schedule.num_microbatches == m
        if v is not None and schedule.placement.style == "loop":
            assert schedule.chunks_per_rank == v


@SETTINGS
@given(
    name=st.sampled_from(names()),
    p=st.one_of(st.integers(-3, 12), st.floats(allow_nan=True), st.text(max_size=3), st.none(), st.booleans()),
    m=st.one_of(st.integers(-3, 40), st.floats(allow_nan=True), st.text(max_size=3), st.none()),
    v=st.one_of(st.none(), st.integers(-2, 6), st.floats(allow_nan=True), st.text(max_size=2)),
    memory_limit=st.one_of(st.none(), st.integers(-2, 40), st.floats(allow_nan=True, allow_infinity=True)),
)
def test_bad_input_never_crashes(name: str, p: object, m: object, v: object, memory_limit: object) -> None:
    _generate_or_error(name, p, m, v=v, memory_limit=memory_limit)


@settings(max_examples=80, deadline=None)
@given(p=st.integers(2, 8), m=st.integers(1, 40), v=st.integers(2, 4), group=st.integers(1, 40))
def test_interleaved_group_sizes(p: int, m: int, v: int, group: int) -> None:
    schedule = _generate_or_error("interleaved-1f1b", p, m, v=v, microbatch_group_size=group)
    megatron_accepts = p <= group <= m and not 0 < m % group < p
    assert (schedule is not None) == megatron_accepts
    if schedule is not None:
        for r, row in enumerate(schedule.ops):
            w = interleaved_warmup(p, r, m, v, group)
            assert all(op.kind.value == "F" for op in row[:w])
            if w < m * v:
                assert row[w].kind.value == "F" and row[w + 1].kind.value == "BW"
