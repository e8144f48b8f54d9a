"""TimingProgram re-times a lowered schedule exactly as the simulator does."""

from __future__ import annotations

import inspect
import random

import pytest

from megatron_pp_ext.analysis.schedule_check import validate
from megatron_pp_ext.analysis.simulate import simulate
from megatron_pp_ext.planner.retiming import TimingProgram
from megatron_pp_ext.schedules import registry
from megatron_pp_ext.schedules.costs import Costs
from megatron_pp_ext.schedules.ir import ScheduleError

MODES = ("async", "blocking") if "comm" in inspect.signature(simulate).parameters else ("blocking",)


def _random_costs(rng: random.Random, stages: int) -> Costs:
    return Costs(
        tuple(rng.uniform(0.5, 1.5) for _ in range(stages)),
        tuple(rng.uniform(0.5, 1.5) for _ in range(stages)),
        tuple(rng.uniform(0.2, 1.2) for _ in range(stages)),
        None,
        rng.choice([0.0, 0.07, 1.5]),
    )


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("p", "m"), [(1, 3), (2, 3), (2, 8), (4, 6), (4, 12), (6, 12)])
def test_matches_simulate_for_every_registered_schedule(mode: str, p: int, m: int) -> None:
    rng = random.Random(7 * p + m)
    kwargs = {"comm": mode} if len(MODES) > 1 else {}
    checked = 0
    for name in registry.names():
        try:
            schedule = registry.generate(name, p, m)
        except ScheduleError:
            continue
        lowered = validate(schedule)
        first = simulate(schedule, _random_costs(rng, schedule.num_stages), lowered=lowered, **kwargs)
        for program in (TimingProgram(lowered, mode), TimingProgram(lowered, mode, first.starts)):
            for _ in range(3):
                costs = _random_costs(rng, schedule.num_stages)
                expected = simulate(schedule, costs, lowered=lowered, **kwargs)
                got = program.run(costs)
                assert got.makespan == pytest.approx(expected.makespan, rel=1e-12, abs=1e-12), name
                assert got.busy == pytest.approx(expected.busy, rel=1e-12, abs=1e-12), name
                assert got.span == pytest.approx(expected.span, rel=1e-12, abs=1e-12), name
        checked += 1
    assert checked >= 2  # at least the baselines
