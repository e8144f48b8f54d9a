"""Every registered schedule over a (p, m, v) grid passes validate(), incl. M < P and M % P != 0."""

from __future__ import annotations

import pytest

from megatron_pp_ext.analysis.schedule_check import ScheduleValidationError, validate
from megatron_pp_ext.schedules import BW, F, Schedule, ScheduleError, generate, loop_placement, names
from tests.tiers import slow_params

GRID = [(p, m, v) for p in (1, 2, 3, 4, 5, 8) for m in range(1, 2 * p + 3) for v in (None, 1, 2, 3)]


def _schedules(name: str) -> list[Schedule]:
    out = []
    for p, m, v in GRID:
        try:
            out.append(generate(name, p, m, v=v))
        except ScheduleError:
            continue
    return out


@pytest.mark.parametrize("name", slow_params(names(), {"interleaved-zb", "zb-auto"}))
def test_registered_schedules_validate(name: str) -> None:
    schedules = _schedules(name)
    assert schedules, f"{name} builds nothing on the grid"
    for schedule in schedules:
        lowered = validate(schedule)
        assert len(lowered.programs) == schedule.num_ranks


@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 2), (4, 8, 2), (3, 9, 3), (2, 2, 2), (4, 4, 3), (8, 16, 2)])
def test_interleaved_is_deadlock_free_under_rendezvous(p: int, m: int, v: int) -> None:
    # m >= 2p: two neighbours each send a gradient whose receive the plain "receive just before
    # the consumer" rule puts in the peer's next exchange; the lowering must post it earlier
    # (as megatron does) or both ranks wait forever on NCCL.
    validate(generate("interleaved-1f1b", p, m, v=v))


@pytest.mark.parametrize(
    "ops",
    [((F(0, -1), BW(0, -1)),), ((F(-1, 0), BW(-1, 0)),)],
    ids=["negative-microbatch", "negative-stage"],
)
def test_negative_indices_are_rejected(ops: tuple[tuple[object, ...], ...]) -> None:
    # Op is a plain named tuple (no checks at construction): validate() must not let a negative
    # index alias the last stage or micro-batch through Python's negative indexing.
    with pytest.raises(ScheduleValidationError, match="-1"):
        validate(Schedule(loop_placement(1), 1, ops))  # type: ignore[arg-type]
