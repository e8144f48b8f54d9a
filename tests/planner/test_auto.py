"""``auto``: the fastest schedule that fits, the same as an exhaustive plan's first row."""

from __future__ import annotations

import pytest

from megatron_pp_ext.planner import Planner, SearchSpace
from megatron_pp_ext.planner.auto import AUTO_MEMORY_LIMITS, auto_space, decide
from megatron_pp_ext.planner.cost_model import CostModel, get_device
from megatron_pp_ext.planner.memory import GIB, TrainingSetup
from megatron_pp_ext.planner.models import get_model
from megatron_pp_ext.schedules import names

PRESETS = [  # model, GPUs, global batch, pp, micro-batch, device
    ("zb-1.5b", 8, 48, 8, 2, "A100-80GB"),
    ("zb-6.2b", 8, 48, 4, 2, "A100-80GB"),
    ("cm-9.6b", 16, 64, 8, 1, "H100-80GB"),
    ("tiny", 4, 16, 4, 1, "CPU"),
]


def _planner(model: str, gpus: int, batch: int, pp: int, mb: int, device: str, **space: object) -> Planner:
    spec = get_model(model)
    setup = TrainingSetup(precision="fp32", attention="unfused") if device == "CPU" else TrainingSetup()
    cost = CostModel(spec, get_device(device), setup)
    shape = {"tp": (1,), "pp": (pp,), "micro_batch": (mb,), "recompute": ("none",), "virtual": (1, 2)}
    return Planner(spec, gpus, batch, cost, space=SearchSpace(**shape, **space))  # type: ignore[arg-type]


@pytest.mark.parametrize("preset", PRESETS, ids=lambda c: f"{c[0]}-p{c[3]}")
@pytest.mark.slow
def test_auto_picks_the_first_row_of_an_exhaustive_plan(preset: tuple) -> None:
    exhaustive = _planner(*preset, schedules=tuple(names()), memory_limits=AUTO_MEMORY_LIMITS).run(progress=False)
    decision = decide(_planner(*preset))
    assert decision.chosen is not None and exhaustive.rows
    assert decision.chosen.config.id == exhaustive.rows[0].config.id
    assert decision.chosen.iteration_time == exhaustive.rows[0].iteration_time
    table = decision.table()
    assert table.startswith("pipeline schedule auto: ") and decision.chosen.config.schedule in table


@pytest.mark.slow
def test_a_budget_below_the_2p_schedules_never_picks_one() -> None:
    """Budget between the p-memory schedules (zb-h1) and the 2p ones (zb-h2, zb-auto@2p): the choice fits, no
    2p schedule is chosen, and the table says why they were dropped."""
    preset = ("zb-6.2b", 8, 48, 8, 2, "A100-80GB")
    rows = {
        f"{r.config.schedule}@{r.config.memory_limit}": r
        for r in _planner(*preset, schedules=tuple(names()), memory_limits=AUTO_MEMORY_LIMITS).run(progress=False).rows
    }
    low, high = rows["zb-h1@None"].peak_memory, rows["zb-h2@None"].peak_memory
    assert low < high
    planner = _planner(*preset)
    planner.budget_bytes = (low + high) / 2
    decision = decide(planner)
    chosen = decision.chosen
    assert chosen is not None and chosen.peak_memory <= planner.budget_bytes
    two_p = {"zb-h2", "zb-auto@2p", "v-zb@2p"}
    label = chosen.config.schedule + (f"@{chosen.config.memory_limit}" if chosen.config.memory_limit else "")
    assert label not in two_p
    assert all(r.peak_memory <= planner.budget_bytes for r in decision.result.rows)
    assert "dropped zb-h2: over budget" in decision.table()
    assert planner.budget_bytes < 1000 * GIB


def test_auto_space_adds_every_schedule_and_the_limits() -> None:
    space = auto_space(SearchSpace(schedules=("1f1b",), memory_limits=("12",)))
    assert space.schedules is None and space.memory_limits == ("12", *AUTO_MEMORY_LIMITS)


def test_planner_times_overlap_pairs_as_the_simulator_does() -> None:
    """The planner's timing of dualpipev (its F&B pairs) equals ``simulate(overlap=F)`` for F = 0, 0.5 and 1,
    also once the schedule is simulated often enough to get a compiled timing program (which runs pairs
    serially, so it must not be used when F > 0)."""
    from megatron_pp_ext.analysis.schedule_check import validate
    from megatron_pp_ext.analysis.simulate import simulate
    from megatron_pp_ext.planner.memo import COMPILE_AFTER
    from megatron_pp_ext.schedules import registry
    from megatron_pp_ext.schedules.costs import Costs

    schedule = registry.generate("dualpipev", 4, 16)
    assert schedule.overlap_pairs and any(schedule.overlap_pairs)
    lowered = validate(schedule)
    for overlap in (0.0, 0.5, 1.0):
        planner = _planner(*PRESETS[0])
        planner.overlap = overlap
        built = planner.build("dualpipev", 4, 16, None, None, None)
        for i in range(COMPILE_AFTER + 3):  # distinct costs (3 digits: the planner's key): new simulations
            f, b, w = 1.0, 1.1 + i / 10, 0.9
            costs = Costs((f,) * 8, (b,) * 8, (w,) * 8, None, 0.05)
            makespan, busy, _ = planner.simulated_times(("dualpipev", 4, 16, None, None, None), built, costs)
            expected = simulate(schedule, costs, lowered=lowered, overlap=overlap)
            assert makespan == pytest.approx(expected.makespan, rel=1e-9), (overlap, i)
            assert busy == pytest.approx(max(expected.busy), rel=1e-9), (overlap, i)


@pytest.mark.parametrize("overlap", [0.0, 1.0])
@pytest.mark.slow
def test_auto_honours_the_overlap_factor(overlap: float) -> None:
    """With the overlap factor, auto still picks the exhaustive plan's first row; at F = 1 dualpipev's
    best time is below its serial one (its pairs hide a whole op)."""
    preset = PRESETS[1]  # zb-6.2b on p=4 (dualpipev applies)
    exhaustive = _planner(*preset, schedules=tuple(names()), memory_limits=AUTO_MEMORY_LIMITS)
    exhaustive.overlap = overlap
    rows = exhaustive.run(progress=False).rows
    planner = _planner(*preset)
    planner.overlap = overlap
    decision = decide(planner)
    assert decision.chosen is not None and decision.chosen.config.id == rows[0].config.id
    serial = _planner(*preset, schedules=("dualpipev",)).run(progress=False).rows[0].iteration_time
    mine = next(r for r in rows if r.config.schedule == "dualpipev").iteration_time
    assert (mine < serial) if overlap else (mine == serial)
    if overlap:
        assert "overlap F=1" in decision.table()


def test_plan_overlap_flag_range(capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_pp_ext.cli import main

    with pytest.raises(SystemExit):
        main(["plan", "--model", "zb-1.5b", "--overlap", "1.5"])
    err = capsys.readouterr().err
    assert "--overlap" in err and "1.5" in err
