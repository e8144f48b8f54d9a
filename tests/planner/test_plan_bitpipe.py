"""BitPipe in the planner: two copies of every slice in memory, the replica sync on the data-parallel
stream, and the schedule's constraints named in a plan."""

from __future__ import annotations

import pytest

from megatron_pp_ext.analysis import simulate
from megatron_pp_ext.planner import Planner, SearchSpace
from megatron_pp_ext.planner.cost_model import CostModel, get_device
from megatron_pp_ext.planner.dp_stream import exposed_dp_time, reduction_profile
from megatron_pp_ext.planner.memory import TrainingSetup, rank_memory, rank_parameters, stage_layout
from megatron_pp_ext.planner.models import get_model
from megatron_pp_ext.schedules import generate
from megatron_pp_ext.schedules.collectives import CollectivePolicy
from megatron_pp_ext.schedules.costs import Costs
from megatron_pp_ext.schedules.placement import make_placement

SPEC = get_model("zb-1.5b")  # 22 layers: with embedding and loss counted, 24 = 3 per stage of 2p = 8


@pytest.mark.parametrize("p", [2, 4, 8])
def test_each_rank_holds_both_copies_of_its_slices(p: int) -> None:
    """Rank r of a bidirectional placement holds the V-placement slices of ranks r and p-1-r (one copy
    from each replica), with gradients and Adam state for both, as megatron allocates them."""
    split = (2,) * (2 * p)
    bidir = rank_parameters(SPEC, 1, stage_layout(make_placement("bidirectional", p, 4), split), p)
    v = rank_parameters(SPEC, 1, stage_layout(make_placement("v", p, 2), split), p)
    assert bidir == [pytest.approx(v[r] + v[p - 1 - r]) for r in range(p)]
    schedule = generate("bitpipe", p, 2 * p)
    memory = rank_memory(
        SPEC, TrainingSetup(), tensor_parallel=1, data_parallel=1, micro_batch=1, recompute="none",
        schedule=schedule, split=split,
    )  # fmt: skip
    for mem, n in zip(memory, bidir, strict=True):
        assert mem.parameters == pytest.approx(n)
        assert mem.weights + mem.gradients + mem.optimizer == pytest.approx(18 * n)  # bf16 + fp32 grads + Adam


@pytest.mark.parametrize("name", ["bitpipe", "bitpipe-zb"])
@pytest.mark.parametrize(("p", "m"), [(4, 4), (4, 8), (8, 16)])
def test_replica_sync_estimate_bounds_the_simulator(name: str, p: int, m: int) -> None:
    """The planner's stream (each chunk's replica all-reduce issued after its last backward) against the
    simulator's (which also waits for the mirror rank): an upper bound, and eager sync hides most of it."""
    schedule = generate(name, p, m)
    costs = Costs(1.0, 2.0, 0.0, None, 0.0) if name == "bitpipe" else Costs(1.0, 1.0, 1.0, None, 0.0)
    tables = costs.per_stage(schedule.num_stages)
    plain = simulate(schedule, costs).makespan
    policy = CollectivePolicy(reduce_grads=False, replica_sync=True)
    for per_chunk in (0.5, 2.0, 8.0):
        chunk_time = [dict.fromkeys(schedule.placement.stages_on_rank(r), per_chunk) for r in range(p)]
        estimate = exposed_dp_time(reduction_profile(schedule), tables, chunk_time)
        simulated = simulate(schedule, costs, collectives=policy, dp_bandwidth=1.0, param_bytes=per_chunk).makespan
        assert simulated - plain - 1e-9 <= estimate < 4 * per_chunk  # 4 chunks per rank: never all exposed
        if per_chunk <= 0.5:
            assert estimate == pytest.approx(per_chunk)  # only the last chunk's sync is left


def test_plan_rows_pay_the_replica_sync_on_the_stream() -> None:
    """No data parallelism: what a bitpipe row pays after the pipeline is the replica sync of each rank
    (whole, split over its chunks by layers) on the stream, issued chunk by chunk after each chunk's last
    backward: one chunk's share is left, not a fixed fraction of the whole."""
    cost = CostModel(SPEC, get_device("A100-80GB"), TrainingSetup())
    space = SearchSpace(tp=(1,), pp=(4,), micro_batch=(1,), recompute=("none",), schedules=("bitpipe",))
    rows = Planner(SPEC, 4, 8, cost, space=space).run(progress=False).rows
    assert len(rows) == 1
    row = rows[0]
    assert (row.config.dp, row.config.num_microbatches) == (1, 8)
    schedule = generate("bitpipe", 4, 8)
    layout = stage_layout(schedule.placement, row.config.split)
    costs = cost.stage_costs(layout, micro_batch=1, tensor_parallel=1, pipeline=4, data_parallel=1, recompute="none")
    chunk_time = []
    for rank, mem in enumerate(row.memory):
        whole = cost.replica_sync_time(mem.parameters, 1, 4, 1)
        mine = [info for info in layout if info.rank == rank]
        chunk_time.append({i.stage: whole * i.layers / sum(j.layers for j in mine) for i in mine})
    expected = exposed_dp_time(reduction_profile(schedule), costs.per_stage(len(layout)), chunk_time)
    assert row.dp_time == pytest.approx(expected)
    whole = max(cost.replica_sync_time(mem.parameters, 1, 4, 1) for mem in row.memory)
    assert 0 < row.dp_time <= 0.25 * whole + 1e-12  # a quarter: one of the four chunks
    assert row.iteration_time == pytest.approx(row.pipeline_time + row.dp_time + row.optimizer_time)


@pytest.mark.parametrize(
    ("gpus", "pp", "batch", "split", "reason"),
    [
        (12, 3, 72, "auto", "even pipeline size -p/--pipeline-model-parallel-size (2, 4, 6, ...)"),
        (12, 6, 66, "auto", "multiple of p=6 (rounds of p/2 down and p/2 up micro-batches): got m=33"),
        (8, 4, 64, "even", "22 layers do not split over the stages of a bidirectional placement on 4 ranks (8)"),
    ],
)
def test_plan_names_the_constraint_that_refuses_bitpipe(
    gpus: int, pp: int, batch: int, split: str, reason: str
) -> None:
    cost = CostModel(SPEC, get_device("A100-80GB"), TrainingSetup())
    space = SearchSpace(
        tp=(1,), pp=(pp,), micro_batch=(1,), recompute=("none",), schedules=("bitpipe",), layer_split=split
    )
    result = Planner(SPEC, gpus, batch, cost, space=space).run(progress=False)
    assert result.rows == []
    reasons = list(result.inapplicable["bitpipe"])
    assert len(reasons) == 1 and reason in reasons[0], reasons
