"""One candidate's estimates: its per-rank memory (dropped when over the budget), the simulated pipeline time,
the data-parallel time left after it (gradient reductions on their own stream, or FSDP's gathers and
reduce-scatters) and the optimizer step, each at ``m`` (extrapolated from the anchors, or built and
simulated at ``m`` itself when not affine); and :func:`estimate_memory`, one configuration's memory."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..schedules import registry
from ..schedules.costs import Costs
from ..schedules.schedule import Schedule
from .cost_model import model_flops_per_iteration
from .dp_stream import exposed_dp_time, reduction_profile
from .extrapolate import EXACT_FALLBACK, TOLERANCE, affine_at, affine_memory
from .layer_layouts import hybrid_pattern_text, is_uniform, layout_text
from .memo import Built, build_key
from .memory import (
    RankMemory,
    StageInfo,
    TrainingSetup,
    fsdp_rank_memory,
    rank_memory,
    split_layers,
    stage_parameters,
)
from .models import ModelSpec
from .result import PlanRow
from .space import Config
from .variants import Variant, short

if TYPE_CHECKING:
    from .search import Planner


def evaluate(
    planner: Planner, var: Variant, t: int, p: int, d: int, b: int, m: int, recompute: str, fsdp: bool = False
) -> PlanRow | float | str:
    """A row, the worst rank's memory (bytes) if over the budget, or why ``m`` itself is refused.
    ``fsdp``: parameters sharded inside the pipeline (memory and time from planner/fsdp_axis.py)."""
    schedule = var.schedule
    layout = planner.stage_layout(schedule.placement, var.split, t, b, recompute)
    builds = var.builds
    approximate = False
    memory = variant_memory(planner, builds, layout, var.split, t, d, b, recompute, m)
    if memory is None:  # peaks not affine in m: this schedule's memory needs the real m
        if m > EXACT_FALLBACK * p:  # too long to simulate: extrapolate anyway, marked approximate
            approximate = True
            memory = variant_memory(planner, builds, layout, var.split, t, d, b, recompute, m, force=True)
        else:
            exact = exact_builds(planner, var, p, m)
            if isinstance(exact, str):
                return exact
            builds = exact
            memory = variant_memory(planner, builds, layout, var.split, t, d, b, recompute, m)
        assert memory is not None
    stage_params: list[float] = []
    if fsdp:
        _, last_built, last_key = builds[-1]
        assert last_built.schedule is not None
        stage_params = stage_parameters(planner.model, t, layout)
        plan = planner.fsdp_sim.plan(last_key, last_built.schedule)
        memory = fsdp_rank_memory(planner.setup, d, plan, stage_params, memory)
    worst = max(mem.total for mem in memory)
    if worst > planner.budget_bytes:
        return worst
    costs = planner.stage_costs(layout, schedule.placement, t, p, d, b, recompute)
    times = variant_times(planner, builds, costs, m)
    if times is None:  # makespan not affine in m (a greedy schedule): simulate the real m
        if m > EXACT_FALLBACK * p:
            approximate = True
            times = variant_times(planner, builds, costs, m, force=True)
        else:
            exact = exact_builds(planner, var, p, m)
            if isinstance(exact, str):
                return exact
            builds = exact
            times = variant_times(planner, builds, costs, m)
        assert times is not None
    makespan, busy, span = times
    extrapolated = len(builds) > 1
    params = [mem.parameters for mem in memory]
    gathers = 0
    if fsdp:
        dp_time, gathers = fsdp_time(planner, builds, costs, stage_params, t, d, m, makespan)
        opt_time = max(planner.costs.optimizer_time(n / d, 1) for n in params)  # each rank updates its shard
    else:
        per_rank = [planner.costs.dp_time(n, t, d) for n in params]
        if schedule.placement.num_replicas == 2:  # a chunk's replica sum precedes its data-parallel reduction
            per_rank = [x + planner.costs.replica_sync_time(n, t, p, d) for x, n in zip(per_rank, params, strict=True)]
        dp_time = exposed_dp(planner, builds, layout, costs, per_rank, m)
        opt_time = max(planner.costs.optimizer_time(n, d) for n in params)
    iteration = makespan + dp_time + opt_time
    flops = model_flops_per_iteration(planner.model, planner.global_batch)
    peak = planner.costs.device.tflops(planner.setup.precision) * 1e12
    samples = planner.global_batch / iteration
    config = _config(planner, var, t, p, d, b, m, recompute, fsdp)
    return PlanRow(
        config=config,
        iteration_time=iteration,
        pipeline_time=makespan,
        dp_time=dp_time,
        optimizer_time=opt_time,
        samples_per_second=samples,
        tokens_per_second_per_gpu=samples * planner.model.seq_length / planner.num_gpus,
        tflops_per_gpu=flops / (iteration * planner.num_gpus) / 1e12,
        mfu=flops / (iteration * planner.num_gpus * peak),
        bubble_rate=max(0.0, (span - busy) / span) if span > 0 else 0.0,
        sync_bubble_rate=max(0.0, (makespan - busy) / makespan) if makespan > 0 else 0.0,
        memory=memory,
        extrapolated=extrapolated,
        approximate=approximate,
        gathers=gathers,
    )


def _config(
    planner: Planner, var: Variant, t: int, p: int, d: int, b: int, m: int, recompute: str, fsdp: bool
) -> Config:
    """The configuration a row shows: the variant's schedule and flags on the ``t x p x d`` grid."""
    schedule = var.schedule
    return Config(
        schedule=var.name,
        tp=t,
        pp=p,
        dp=d,
        micro_batch=b,
        num_microbatches=m,
        chunks=var.chunks,
        placement=schedule.placement.style,
        recompute=recompute,
        split=var.split,
        v_flag=var.v,
        memory_limit=var.limit,
        costs_flag=",".join(f"{x:g}" for x in var.costs_key) if var.costs_key else None,
        unit_size=var.unit,
        fsdp=fsdp,
        layout=None if is_uniform(planner.model.num_layers, var.split) else _layout_shown(planner.model, var.split),
    )


def fsdp_time(
    planner: Planner,
    builds: Sequence[tuple[int, Built, tuple[Any, ...]]],
    costs: Costs,
    stage_params: Sequence[float],
    t: int,
    d: int,
    m: int,
    makespan: float,
) -> tuple[float, int]:
    """``(exposed FSDP time, gathers per iteration)`` at ``m``: the simulator's iteration with its
    data-parallel stream minus the compute-only makespan (extrapolated from the anchors)."""
    stage_bytes = [n * planner.setup.param_bytes for n in stage_params]
    bandwidth = planner.costs.dp_bandwidth(t, d)
    timings = []
    for _, built, key in builds:
        assert built.schedule is not None and built.lowered is not None
        timings.append(planner.fsdp_sim.time(key, built.schedule, built.lowered, costs, stage_bytes, d, bandwidth))
    if len(timings) == 1:
        iteration, gathers = timings[0].iteration, timings[0].gathers
    else:
        ms = [mm for mm, _, _ in builds]
        iteration = float(affine_at(ms, [x.iteration for x in timings], m, math.inf) or timings[-1].iteration)
        gathers = round(affine_at(ms, [float(x.gathers) for x in timings], m, math.inf) or timings[-1].gathers)
    return max(0.0, iteration - makespan), int(gathers)


def exact_builds(planner: Planner, var: Variant, p: int, m: int) -> list[tuple[int, Built, tuple[Any, ...]]] | str:
    key = build_key(var.name, p, m, var.v, var.limit, var.costs_key, var.unit_arg)
    built = planner.build(var.name, p, m, var.v, var.limit, var.costs_key, var.unit_arg)
    if built.schedule is None:
        return short(built.error)
    planner.stats["exact fallbacks"] += 1
    return [(m, built, key)]


def variant_memory(
    planner: Planner,
    builds: Sequence[tuple[int, Built, tuple[Any, ...]]],
    layout: Sequence[StageInfo],
    split: Sequence[int],
    t: int,
    d: int,
    b: int,
    recompute: str,
    m: int,
    force: bool = False,
) -> list[RankMemory] | None:
    """Per-rank memory at ``m`` (extrapolated from the anchors; ``None`` if not affine)."""
    mems = []
    for _, built, key in builds:
        assert built.schedule is not None
        prof = planner.profile(key, built.schedule, layout)
        mems.append(
            rank_memory(
                planner.model,
                planner.setup,
                tensor_parallel=t,
                data_parallel=d,
                micro_batch=b,
                recompute=recompute,
                schedule=built.schedule,
                split=split,
                profile=prof,
                layout=layout,
            )
        )
    if len(builds) == 1:
        return mems[0]
    return affine_memory([mm for mm, _, _ in builds], mems, m, math.inf if force else TOLERANCE)


def variant_times(
    planner: Planner, builds: Sequence[tuple[int, Built, tuple[Any, ...]]], costs: Costs, m: int, force: bool = False
) -> tuple[float, float, float] | None:
    """``(makespan, busy, span)`` at ``m`` (extrapolated; ``None`` if not affine)."""
    sims = [planner.simulated_times(key, built, costs) for _, built, key in builds]
    if len(sims) == 1:
        return sims[0]
    ms = [mm for mm, _, _ in builds]
    values = [affine_at(ms, [s[i] for s in sims], m, math.inf if force else TOLERANCE) for i in range(3)]
    if any(v is None for v in values):
        return None
    makespan, busy, span = (float(v) for v in values)  # type: ignore[arg-type]
    return makespan, busy, span


def exposed_dp(
    planner: Planner,
    builds: Sequence[tuple[int, Built, tuple[Any, ...]]],
    layout: Sequence[StageInfo],
    costs: Costs,
    per_rank: Sequence[float],
    m: int,
) -> float:
    """Gradient reduction time left after the pipeline: each rank's reduction (``per_rank``)
    split over its chunks by layers, on a stream per rank (:mod:`.dp_stream`); at ``m``
    (extrapolated from the anchors like the makespan)."""
    tables = costs.per_stage(len(layout))
    chunk_time: list[dict[int, float]] = []
    for rank, total in enumerate(per_rank):
        mine = [info for info in layout if info.rank == rank]
        layers = sum(info.layers for info in mine)
        chunk_time.append({info.stage: total * (info.layers / layers if layers else 1 / len(mine)) for info in mine})
    values = []
    for _, built, key in builds:
        assert built.schedule is not None
        profile = planner.memo.reductions.get(key)
        if profile is None:
            profile = planner.memo.reductions[key] = reduction_profile(built.schedule)
        values.append(exposed_dp_time(profile, tables, chunk_time))
    if len(values) == 1:
        return values[0]
    value = affine_at([mm for mm, _, _ in builds], values, m, math.inf)
    return min(max(0.0, float(values[-1] if value is None else value)), max(per_rank, default=0.0))


def estimate_memory(
    model: ModelSpec,
    setup: TrainingSetup,
    schedule: str | Schedule,
    *,
    tp: int,
    pp: int,
    dp: int,
    micro_batch: int,
    num_microbatches: int,
    v: int | None = None,
    recompute: str = "none",
    layer_split: str = "auto",
) -> list[RankMemory]:
    """Per-rank memory of one configuration (builds the schedule with the registry)."""
    sched = schedule if isinstance(schedule, Schedule) else registry.generate(schedule, pp, num_microbatches, v=v)
    split = split_layers(model.num_layers, sched.placement.stages_per_replica, layer_split)
    if split is None:
        raise ValueError(f"{model.num_layers} layers do not split over {sched.placement.stages_per_replica} stages")
    return rank_memory(
        model,
        setup,
        tensor_parallel=tp,
        data_parallel=dp,
        micro_batch=micro_batch,
        recompute=recompute,
        schedule=sched,
        split=split,
    )


def _layout_shown(model: ModelSpec, split: tuple[int, ...]) -> str:
    """A planned layout as megatron takes it: a hybrid model's pattern with ``|`` between the stages, else
    the layout text (:func:`.megatron_args.config_args` writes the same)."""
    if model.hybrid_pattern is not None:
        return hybrid_pattern_text(model.hybrid_pattern, split)
    return layout_text(split)
