"""The planner's exposed data-parallel time (planner/dp_stream.py) against the simulator's stream."""

from __future__ import annotations

import pytest

from megatron_pp_ext.analysis import simulate
from megatron_pp_ext.planner.dp_stream import exposed_dp_time, reduction_profile
from megatron_pp_ext.schedules import generate
from megatron_pp_ext.schedules.costs import Costs


def _both(name: str, p: int, m: int, v: int | None, reduce: float) -> tuple[float, float]:
    """(planner estimate, simulator) of the time the iteration runs past the pipeline."""
    schedule = generate(name, p, m, v=v)
    costs = Costs(1.0, 1.0, 1.0, None, 0.0)
    chunks = schedule.placement.stages_per_rank_per_replica
    per_chunk = reduce / chunks  # all-reduce time of one chunk
    tables = costs.per_stage(schedule.num_stages)
    chunk_time = [dict.fromkeys(schedule.placement.stages_on_rank(r), per_chunk) for r in range(p)]
    estimate = exposed_dp_time(reduction_profile(schedule), tables, chunk_time)
    # simulator: all-reduce over dp=2 takes B / bw; param_bytes = per_chunk at bandwidth 1
    result = simulate(schedule, costs, dp=2, dp_bandwidth=1.0, param_bytes=per_chunk)
    assert result.data_parallel is not None
    return estimate, result.data_parallel.iteration_time - simulate(schedule, costs).makespan


@pytest.mark.parametrize(("name", "v"), [("1f1b", None), ("gpipe", None), ("zb-h1", None)])
def test_one_chunk_per_rank_exposes_the_whole_reduction(name: str, v: int | None) -> None:
    for reduce in (0.5, 3.0, 20.0):
        estimate, simulated = _both(name, 4, 8, v, reduce)
        assert estimate == pytest.approx(reduce) == pytest.approx(simulated)


@pytest.mark.parametrize(("p", "m", "v"), [(4, 4, 2), (4, 8, 2), (4, 8, 4), (8, 16, 2)])
def test_breadth_first_estimate_is_exact(p: int, m: int, v: int) -> None:
    # no idle time behind any reduction on any rank (m >= p, zero communication): the bound is tight
    for reduce in (1.0, 3.0 * m, 12.0 * m):
        estimate, simulated = _both("bfs", p, m, v, reduce)
        assert estimate == pytest.approx(simulated)
        assert estimate < reduce or v == 1


@pytest.mark.parametrize(
    ("name", "p", "m", "v"), [("interleaved-1f1b", 4, 8, 2), ("v-half", 4, 8, None), ("bfs", 4, 3, 2)]
)
def test_estimate_is_an_upper_bound(name: str, p: int, m: int, v: int | None) -> None:
    for reduce in (1.0, 8.0, 40.0):
        estimate, simulated = _both(name, p, m, v, reduce)
        assert estimate >= simulated - 1e-9
        assert estimate <= reduce + 1e-9


def test_planner_rows_use_the_stream() -> None:
    """In a plan, a one-chunk schedule pays its whole reduction after the pipeline (as before) and
    breadth-first with v chunks hides all but its last chunk's (chunks split by layers)."""
    from megatron_pp_ext.planner import Planner, SearchSpace
    from megatron_pp_ext.planner.cost_model import CostModel, get_device
    from megatron_pp_ext.planner.memory import TrainingSetup
    from megatron_pp_ext.planner.models import get_model

    spec = get_model("zb-1.5b")
    cost = CostModel(spec, get_device("A100-80GB"), TrainingSetup())
    space = SearchSpace(
        tp=(1,), pp=(4,), micro_batch=(1,), virtual=(1, 3), recompute=("none",), schedules=("1f1b", "bfs")
    )
    rows = {
        (r.config.schedule, r.config.chunks): r
        for r in Planner(spec, 8, 32, cost, space=space).run(progress=False).rows
    }
    assert set(rows) == {("1f1b", 1), ("bfs", 1), ("bfs", 3)}
    for (_name, chunks), row in rows.items():
        c = row.config
        assert c.dp == 2
        full = max(cost.dp_time(mem.parameters, c.tp, c.dp) for mem in row.memory)
        assert row.iteration_time == pytest.approx(row.pipeline_time + row.dp_time + row.optimizer_time)
        if chunks == 1:
            assert row.dp_time == pytest.approx(full)  # the reduction starts after the rank's last op
        else:
            assert 0 < row.dp_time < 0.5 * full
