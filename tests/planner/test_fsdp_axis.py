"""FSDP inside the pipeline and zeropp's unit size as planner axes (planner/fsdp_axis.py, variants.py, evaluate.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from megatron_pp_ext.analysis import simulate
from megatron_pp_ext.planner import Planner, PlanRow, SearchSpace
from megatron_pp_ext.planner.auto import AUTO_MEMORY_LIMITS, decide
from megatron_pp_ext.planner.cost_model import CostModel, get_device
from megatron_pp_ext.planner.fsdp_axis import fsdp_options
from megatron_pp_ext.planner.megatron_args import config_args
from megatron_pp_ext.planner.memory import TrainingSetup, bytes_per_parameter, stage_layout, stage_parameters
from megatron_pp_ext.planner.models import ModelSpec
from megatron_pp_ext.schedules import generate, names
from megatron_pp_ext.schedules.collectives import declared_fsdp_limit, derive_collectives, policy_for
from megatron_pp_ext.schedules.costs import Costs

# 8 layers of h=2048 at a short sequence: parameters weigh more than activations (where FSDP pays off),
# 16 GPUs = pp 4 x dp 4, global batch 32 = 8 micro-batches per replica; plans in about a second
MODEL = ModelSpec(
    "fsdp-test",
    num_layers=8,
    hidden_size=2048,
    num_attention_heads=16,
    seq_length=128,
    vocab_size=32000,
    untie_embeddings_and_output_weights=True,
)
SETUP = TrainingSetup()


def _planner(model: ModelSpec = MODEL, **space: object) -> Planner:
    cost = CostModel(model, get_device("A100-80GB"), SETUP)
    shape: dict[str, object] = {"tp": (1,), "pp": (4,), "micro_batch": (1,), "recompute": ("none",), "virtual": (1, 2)}
    shape.update(space)
    return Planner(model, 16, 32, cost, space=SearchSpace(**shape))  # type: ignore[arg-type]


def _rows(**space: object) -> list[PlanRow]:
    return _planner(**space).run(progress=False).rows


def test_fsdp_only_where_the_schedule_and_the_runtime_allow_it() -> None:
    assert fsdp_options("bfs", 1, 2, MODEL, (False, True)) == [False, True]
    assert fsdp_options("zeropp", 1, 2, MODEL, (True,)) == [True]
    assert fsdp_options("1f1b", 1, 2, MODEL, (False, True)) == [False]
    assert "does not shard" in str(fsdp_options("1f1b", 1, 2, MODEL, (True,)))
    assert "TP=1" in str(fsdp_options("bfs", 2, 2, MODEL, (True,)))
    tied = ModelSpec("tied", num_layers=8, hidden_size=1024, num_attention_heads=8, seq_length=512)
    assert "tied embeddings" in str(fsdp_options("bfs", 1, 2, tied, (True,)))
    assert "data-parallel size >= 2" in str(fsdp_options("bfs", 1, 1, MODEL, (True,)))
    rows = _rows(schedules=("1f1b", "bfs", "zeropp"), fsdp=(False, True))
    sharded = {r.config.schedule for r in rows if r.config.fsdp}
    assert sharded == {"bfs", "zeropp"}
    assert {r.config.schedule for r in rows if not r.config.fsdp} == {"1f1b", "bfs", "zeropp"}


def test_planner_picks_fsdp_when_memory_forbids_the_replicas() -> None:
    both = _rows(schedules=("1f1b", "bfs"), fsdp=(False, True))
    sharded = min(r.peak_memory for r in both if r.config.fsdp)
    plain = min(r.peak_memory for r in both if not r.config.fsdp)
    assert sharded < plain
    planner = _planner(schedules=("1f1b", "bfs"), fsdp=(False, True))
    planner.budget_bytes = (sharded + plain) / 2
    result = planner.run(progress=False)
    assert result.rows and all(r.config.fsdp for r in result.rows)
    assert result.rows[0].config.schedule == "bfs"
    off = _planner(schedules=("1f1b", "bfs"))
    off.budget_bytes = planner.budget_bytes
    assert off.run(progress=False).rows == []


@pytest.mark.parametrize(("name", "v"), [("bfs", 2), ("zeropp", 2), ("bfs", 1)])
def test_fsdp_memory_follows_the_rules(name: str, v: int) -> None:
    """Shards of params + grads + optimizer over d, the declared number of chunks gathered, and the full
    gradient buffers the runtime keeps until the iteration's end (all of a rank's at its last op)."""
    rows = {
        (r.config.fsdp, r.config.unit_size): r
        for r in _rows(schedules=(name,), fsdp=(False, True), virtual=(v,))
        if r.config.chunks == v
    }
    key_unit = 32 // 4 if name == "zeropp" else None  # m = 32 / dp; zeropp's U = m row
    row, plain = rows[(True, key_unit)], rows[(False, key_unit)]
    d = row.config.dp
    pb, gb, ob = bytes_per_parameter("bf16", False, 1)
    flag = row.config.costs_flag  # zeropp is built for the planner's relative costs
    costs = Costs(*(float(x) for x in flag.split(",")[:3]), None, float(flag.split(",")[3])) if flag else None
    schedule = generate(name, 4, row.config.num_microbatches, v=v, **({"costs": costs} if costs else {}))
    limit = declared_fsdp_limit(schedule)
    assert limit is not None
    plan = derive_collectives(schedule, policy_for(schedule, fsdp=True))
    per_stage = stage_parameters(MODEL, 1, stage_layout(schedule.placement, row.config.split))
    for rank, mem in enumerate(row.memory):
        mine = [per_stage[s] for s in schedule.placement.stages_on_rank(rank)]
        n = sum(mine)
        assert mem.parameters == pytest.approx(n)
        assert mem.optimizer == pytest.approx(n * ob / d)
        # working set: per op, chunks with more unshards than reshards issued up to it, plus full gradient
        # buffers of chunks that had a gradient op (kept to the iteration's end); the peak over the ops
        items = plan.at[rank]
        ops = schedule.ops[rank]
        best = 0.0
        for i in range(len(ops)):
            issued = [c for gap, c in items if gap <= i]
            gathered = [
                s
                for s in set(c.stage for c in issued)
                if sum(1 if c.kind == "unshard" else -1 if c.kind == "reshard" else 0 for c in issued if c.stage == s)
                > 0
            ]
            assert len(gathered) <= limit  # the schedule's declared limit, through policy_for
            grads = {op.stage for op in ops[: i + 1] if op.kind.name in ("B", "W", "BW")}
            best = max(best, pb * sum(per_stage[s] for s in gathered) + gb * sum(per_stage[s] for s in grads))
        assert mem.weights + mem.gradients == pytest.approx(n * (pb + gb) / d + best)
        assert mem.gradients >= n * gb / d + gb * max(mine) - 1e-6  # at least one full buffer
        assert mem.activations == plain.memory[rank].activations
    assert row.peak_memory < plain.peak_memory


@pytest.mark.parametrize("batch", [32, 256])
def test_fsdp_time_is_the_simulators_data_parallel_stream(batch: int) -> None:
    """A row simulated exactly (m = 8) or extrapolated from the anchors (m = 64): its exposed DP time is the
    simulator's iteration with the FSDP stream minus the compute-only makespan, its gathers the lowering's."""
    cost = CostModel(MODEL, get_device("A100-80GB"), SETUP)
    space = SearchSpace(tp=(1,), pp=(4,), micro_batch=(1,), recompute=("none",), virtual=(2,), schedules=("bfs",))
    result = Planner(MODEL, 16, batch, cost, space=replace(space, fsdp=(True,))).run(progress=False)
    row = next(r for r in result.rows if r.config.fsdp)
    assert row.extrapolated == (batch > 32)
    schedule = generate("bfs", 4, row.config.num_microbatches, v=2)
    planner = _planner()
    layout = stage_layout(schedule.placement, row.config.split)
    costs = planner.costs.stage_costs(
        layout, micro_batch=1, tensor_parallel=1, pipeline=4, data_parallel=row.config.dp, recompute="none"
    )
    sizes = [n * SETUP.param_bytes for n in stage_parameters(MODEL, 1, layout)]
    result = simulate(
        schedule,
        Costs(*costs.per_stage(schedule.num_stages)[:3], None, costs.t_comm),
        collectives=policy_for(schedule, fsdp=True),
        dp=row.config.dp,
        dp_bandwidth=planner.costs.dp_bandwidth(1, row.config.dp),
        param_bytes=sizes,
    )
    data = result.data_parallel
    assert data is not None
    compute_only = simulate(schedule, Costs(*costs.per_stage(schedule.num_stages)[:3], None, costs.t_comm)).makespan
    assert row.pipeline_time == pytest.approx(compute_only, rel=2e-3)
    assert row.dp_time == pytest.approx(data.iteration_time - compute_only, rel=1e-2, abs=1e-6)
    assert row.dp_time > 0
    assert row.gathers == max(data.gathers(r) for r in range(4)) == 2 * 2 - 1  # bfs, limit 1: 2v - 1


def test_zeropp_unit_sizes_are_an_axis() -> None:
    rows = [r for r in _rows(schedules=("zeropp",), fsdp=(True,), virtual=(2,)) if r.config.chunks == 2]
    m = rows[0].config.num_microbatches
    assert sorted({r.config.unit_size for r in rows}) == [u for u in range(1, m + 1) if m % u == 0]
    assert len({r.config.id for r in rows}) == len(rows)
    small = next(r for r in rows if r.config.unit_size == 1)
    whole = next(r for r in rows if r.config.unit_size == m)
    # a unit of U keeps about U micro-batches per chunk alive; U = 1 interleaves the chunks' backwards, so both
    # chunks stay gathered while both full gradient buffers are alive: a larger working set (weights + grads)
    assert max(x.activations for x in small.memory) < max(x.activations for x in whole.memory)
    assert max(x.weights + x.gradients for x in small.memory) > max(x.weights + x.gradients for x in whole.memory)
    args = config_args(small.config, TrainingSetup(distributed_optimizer=True), 32)
    assert "--pipeline-fsdp" in args and args[args.index("--pipeline-unit-size") + 1] == "1"
    assert "--use-distributed-optimizer" not in args  # FSDP shards the optimizer state itself
    only = [r for r in _rows(schedules=("zeropp",), unit_sizes=(2, 3), virtual=(2,)) if r.config.chunks == 2]
    assert {r.config.unit_size for r in only} == {2}  # 3 does not divide m = 8


@pytest.mark.slow
def test_auto_picks_the_first_row_of_the_exhaustive_plan_with_fsdp_and_units() -> None:
    exhaustive = _planner(schedules=tuple(names()), memory_limits=AUTO_MEMORY_LIMITS, fsdp=(False, True))
    rows = exhaustive.run(progress=False).rows
    planner = _planner()
    decision = decide(planner)
    assert decision.chosen is not None
    assert decision.chosen.config.id == rows[0].config.id
    assert decision.chosen.iteration_time == rows[0].iteration_time
    assert any(r.config.fsdp for r in decision.result.rows) and any(r.config.unit_size for r in decision.result.rows)
    table = decision.table()
    assert "fsdp" in table.splitlines()[1] and "gathers" in table.splitlines()[1]
    # budget below every unsharded row: auto must take a sharded one
    planner = _planner()
    planner.budget_bytes = min(r.peak_memory for r in rows if not r.config.fsdp) * 0.999
    chosen = decide(planner).chosen
    assert chosen is not None and chosen.config.fsdp and chosen.peak_memory <= planner.budget_bytes
