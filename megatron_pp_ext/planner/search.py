"""The search: :class:`Planner` enumerates every configuration of a model on a GPU count at a global batch
whose shapes divide (``TP`` divides the heads and at most one node, ``TP*PP*DP = GPUs``, ``DP*micro_batch``
divides the global batch), each registered schedule's variants at it (:mod:`.variants`: chunk counts,
memory limits, unit sizes; a generator that refuses ``(p, m, v)`` makes the configuration inapplicable,
with its reason), evaluates them (:mod:`.evaluate`: memory, simulated time, extrapolated from anchors,
:mod:`.extrapolate`) and ranks those within the memory budget by estimated throughput. Schedules,
their validation, activation profiles and simulations are kept in a :class:`.memo.PlannerMemo`; slow
generators' output on disk in a :class:`.schedule_cache.ScheduleCache`."""

from __future__ import annotations

import math
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

from ..analysis.schedule_check import validate
from ..analysis.simulate import simulate
from ..schedules import registry
from ..schedules.costs import Costs
from ..schedules.ir import ScheduleError
from ..schedules.limits import OPS_PER_PAIR
from ..schedules.placement import Placement
from ..schedules.schedule import Schedule
from .cost_model import CostModel
from .extrapolate import anchor_counts
from .fsdp_axis import FsdpSimulator, fsdp_options
from .layer_costs import LayerCostTable, MeasuredLayers, kind_layout, layer_cost_table
from .layer_costs import stage_costs as layer_stage_costs
from .layer_layouts import MAX_CANDIDATES
from .layout_search import evaluate_layouts
from .memo import (
    POST_VALIDATION_ITERATIONS,
    SIM_KWARGS,
    SIM_OVERLAP,
    Built,
    PlannerMemo,
    Sim,
    build_key,
    normalise,
    simulate_once,
)
from .memory import GIB, ActivationProfile, StageInfo, TrainingSetup, activation_profile, stage_layout
from .models import ModelSpec
from .result import PlanResult, PlanRow
from .schedule_cache import DISK_CACHE_MIN_SECONDS, ScheduleCache
from .space import NO_PIPELINE_SCHEDULE, SearchSpace, default_schedules, divisors
from .variants import feasible_chunks, first_line, resolve_limit, schedule_variants


class Planner:
    """Enumerates, filters and ranks configurations (see the module doc)."""

    def __init__(
        self,
        model: ModelSpec,
        num_gpus: int,
        global_batch: int,
        cost_model: CostModel,
        *,
        memory_budget_gib: float | None = None,
        memory_reserve_gib: float = 2.0,
        space: SearchSpace | None = None,
        cache_dir: str | Path | None = None,
        w_memory: float | None = None,
        post_validation: bool = False,
        memo: PlannerMemo | None = None,
        overlap: float = SIM_OVERLAP,
        measured_layers: MeasuredLayers | None = None,
    ) -> None:
        if num_gpus < 1:
            raise ValueError(f"number of GPUs must be >= 1, got {num_gpus}")
        if global_batch < 1:
            raise ValueError(f"global batch must be >= 1, got {global_batch}")
        if isinstance(overlap, bool) or not 0.0 <= overlap <= 1.0:
            raise ValueError(f"overlap must be a number in [0, 1], got {overlap!r}")
        self.overlap = float(overlap)  # timing of overlap pairs: max + (1 - overlap) x min, as simulate()
        self.model = model
        self.num_gpus = int(num_gpus)
        self.global_batch = int(global_batch)
        self.costs = cost_model
        self.setup: TrainingSetup = cost_model.setup
        # what a pending W keeps, for the schedules that count it (zb-auto); None = whole activations
        self.w_memory = None if w_memory is None or w_memory == 1.0 else float(w_memory)
        # optimizer post-validation: an iteration takes the simulator's back-to-back time without the
        # step synchronisation (schedules.timing.repeat_iterations), and zb-auto minimises it
        self.post_validation = bool(post_validation)
        budget = cost_model.device.memory_gib if memory_budget_gib is None else memory_budget_gib
        self.budget_bytes = (budget - memory_reserve_gib) * GIB
        self.space = space or SearchSpace()
        # v-block without a block file is v-half's block: list it only when asked for
        names = self.space.schedules if self.space.schedules is not None else default_schedules()
        self.schedule_names = tuple(registry.get(n).name for n in names)
        self.memo = memo if memo is not None else PlannerMemo()
        self._built = self.memo.built
        self._profiles = self.memo.profiles
        self._sims = self.memo.sims
        self._reductions = self.memo.reductions
        self.stats: Counter[str] = Counter()
        self.disk_cache = ScheduleCache(cache_dir) if cache_dir is not None else None
        self.fsdp_sim = FsdpSimulator()
        # per-layer costs (embedding, each layer's kind, head; planner/layer_costs.py) for the layout search and
        # for models whose layers differ; a model of equal dense layers otherwise keeps the per-stage model
        self.measured_layers = measured_layers
        self._tables: dict[tuple[int, int, str], LayerCostTable] = {}
        self.memo_layouts: dict[tuple[Any, ...], list[tuple[int, ...]]] = {}  # candidate layouts per placement

    @property
    def per_layer(self) -> bool:
        """Whether stage costs and memory come from per-layer costs (planner/layer_costs.py)."""
        return self.space.layer_split == "search" or not self.model.uniform_layers or self.measured_layers is not None

    def layer_table(self, micro_batch: int, tensor_parallel: int, recompute: str) -> LayerCostTable:
        """Every layer's times at this micro-batch, TP size and recompute setting (kept per planner)."""
        key = (micro_batch, tensor_parallel, recompute)
        table = self._tables.get(key)
        if table is None:
            table = layer_cost_table(self.costs, micro_batch, tensor_parallel, recompute, self.measured_layers)
            self._tables[key] = table
        return table

    def stage_layout(
        self, placement: Placement, split: Sequence[int], t: int, b: int, recompute: str
    ) -> tuple[StageInfo, ...]:
        """The stages of ``placement`` under ``split``, weighted by their layers' kinds when per-layer."""
        if not self.per_layer:
            return stage_layout(placement, split)
        return kind_layout(self.model, self.setup, placement, split, t, b, recompute)

    def stage_costs(
        self, layout: Sequence[StageInfo], placement: Placement, t: int, p: int, d: int, b: int, recompute: str
    ) -> Costs:
        """The simulator's per-stage costs of ``layout`` (per-layer, or the cost model's per-stage ones)."""
        if not self.per_layer:
            return self.costs.stage_costs(
                layout, micro_batch=b, tensor_parallel=t, pipeline=p, data_parallel=d, recompute=recompute
            )
        comm = self.costs.p2p_time(b, t, p, d)
        return layer_stage_costs(self.layer_table(b, t, recompute), layout, placement, comm)

    # ---- enumeration ----------------------------------------------------------------------------
    def shapes(self) -> Iterator[tuple[int, int, int, int, int]]:
        """``(tp, pp, dp, micro_batch, num_microbatches)`` whose sizes divide."""
        model, n = self.model, self.num_gpus
        max_tp = self.space.max_tp or self.costs.device.gpus_per_node
        tps = self.space.tp or tuple(divisors(n))
        for t in tps:
            if n % t or t > max_tp or (t > 1 and self.costs.device.gpus_per_node % t):
                continue  # a TP group must sit inside one node
            if model.num_attention_heads % t or model.query_groups % t or model.ffn % t:
                continue
            pps = self.space.pp or tuple(divisors(n // t))
            for p in pps:
                if (n // t) % p or p > 2 * model.num_layers:
                    continue
                d = n // (t * p)
                if self.global_batch % d:
                    continue
                per_replica = self.global_batch // d
                for b in self._micro_batches(per_replica):
                    yield t, p, d, b, per_replica // b

    def _micro_batches(self, per_replica: int) -> list[int]:
        if self.space.micro_batch is not None:
            return [b for b in self.space.micro_batch if per_replica % b == 0]
        cands = {1, 2, 4, 8, 16}
        if self.model.default_micro_batch:
            cands.add(self.model.default_micro_batch)
        return sorted(b for b in cands if per_replica % b == 0)

    def count_steps(self) -> int:
        """(shape, schedule, memory limit) triples :meth:`run` visits (the progress bar's total)."""
        return sum(len(self.schedules_at(p)) * len(self.limits_at(p)) for _, p, *_ in self.shapes())

    def search_ops(self) -> int:
        """An upper estimate of the search's work in schedule ops, cheap to compute (no schedule is built):
        :meth:`search_cost`'s builds plus its evaluations. :meth:`check_search` refuses a search over
        :data:`MAX_SEARCH_OPS` up front."""
        builds, evaluations = self.search_cost()
        return round(builds + evaluations)

    def search_cost(self) -> tuple[int, int]:
        """``(builds, evaluations)`` in weighted schedule ops. ``builds``: every distinct build of
        :func:`builds_at` (schedule, p, micro-batches, chunks, memory limit, unit size; the shapes that share one
        share it, as :class:`.memo.PlannerMemo` does) once, its ops times its generator's factor (generation,
        validation, lowering, buffer counts and compiled timing are per build). ``evaluations``: at every shape
        (TP, micro-batch, DP) that uses the build, its ops times :meth:`shape_evaluations` (each evaluation times
        and sizes it with that shape's costs); an extrapolated build counts its anchors' short runs, never ``m``."""
        uses: dict[tuple[Any, ...], float] = {}  # (memory limit, *build) -> its evaluations' weight over its shapes
        for t, p, d, _, m in self.shapes():
            for name in self.schedules_at(p):
                feasible = feasible_chunks(self, registry.get(name).placement, p)
                weight = self.shape_evaluations(name, t, d)
                for limit in self.limits_at(p):
                    for key in builds_at(name, p, m, self.space, feasible):
                        uses[(limit, *key)] = uses.get((limit, *key), 0.0) + weight
        builds = sum(int(key[-1]) + BUILD_OVERHEAD for key in uses)
        evaluations = round(sum(int(key[-2]) * weight for key, weight in uses.items()))
        return builds, evaluations

    def shape_evaluations(self, name: str, t: int, d: int) -> float:
        """The weight of one variant's evaluations at one shape, per op of its build: per recompute setting, per
        layout (:meth:`layouts_per_candidate`) and per FSDP setting the candidate runs
        (:func:`.fsdp_axis.fsdp_options`; none where it refuses them all), :data:`FSDP_EVALUATION_WEIGHT` with FSDP (its
        data-parallel stream simulated), else :data:`EVALUATION_WEIGHT`, or :data:`PER_LAYER_EVALUATION_WEIGHT`
        with per-layer costs (each layout's stages sized from their layer kinds, its activation profile anew)."""
        shards = fsdp_options(name, t, d, self.model, self.space.fsdp or (False,))
        if isinstance(shards, str):
            return 0.0
        plain = PER_LAYER_EVALUATION_WEIGHT if self.per_layer else EVALUATION_WEIGHT
        per_candidate = sum(FSDP_EVALUATION_WEIGHT if fsdp else plain for fsdp in shards)
        return per_candidate * len(self.space.recompute) * self.layouts_per_candidate()

    def layouts_per_candidate(self) -> int:
        """The layouts one candidate is evaluated under: the uniform split and up to
        :data:`.layer_layouts.MAX_CANDIDATES` planned ones with ``--layer-split search``, else one."""
        return 1 + MAX_CANDIDATES if self.space.layer_split == "search" and self.space.layout is None else 1

    def check_search(self) -> None:
        """Refuse, before any schedule is built, a search with no shape or one too large to finish in minutes."""
        if next(iter(self.shapes()), None) is None:
            raise ValueError(no_shape_reason(self))
        ops = self.search_ops()
        if ops > MAX_SEARCH_OPS:
            raise ValueError(
                f"the search would cost about {ops:,} schedule ops ({self.num_gpus} GPUs, global batch "
                f"{self.global_batch}); the limit is {MAX_SEARCH_OPS:,} ({LIMIT_COST}): narrow "
                "it with --pp, --tp, --micro-batch, --schedules, --virtual or --unit-sizes, "
                "or a smaller --global-batch"
            )

    def schedules_at(self, p: int) -> tuple[str, ...]:
        """The schedules searched at pipeline size ``p``. Without a pipeline (``p = 1``) every schedule is
        the same forward-backward loop, megatron's ``forward_backward_no_pipelining``, and chunks per rank
        only mean megatron refusing the run (its interleaved schedule needs ``pp > 1``): that configuration
        is evaluated once, as ``1f1b`` with one chunk (listed as ``none (pp=1)``)."""
        if p > 1 or not self.schedule_names:
            return self.schedule_names
        return (NO_PIPELINE_SCHEDULE,)

    def limits_at(self, p: int) -> tuple[str | None, ...]:
        """The memory limits tried at pipeline size ``p`` (None: the schedule's own); none without a pipeline."""
        return (None, *self.space.memory_limits) if p > 1 else (None,)

    # ---- schedules ------------------------------------------------------------------------------
    def build(
        self,
        name: str,
        p: int,
        m: int,
        v: int | None,
        memory_limit: str | None,
        costs_key: tuple[float, ...] | None,
        unit: int | None = None,
    ) -> Built:
        """Schedule ``name`` at this shape, validated (or why not), built once per planner memo (and read
        from the disk cache when its generator is slow)."""
        key = build_key(name, p, m, v, memory_limit, costs_key, unit)
        w_memory = self.w_memory if self.w_memory is not None and registry.get(name).takes("w_memory") else None
        if w_memory is not None:
            key += (("w_memory", w_memory),)
        objective = "span" if self.post_validation and registry.get(name).takes("objective") else None
        if objective is not None:
            key += (("objective", objective),)
        hit = self._built.get(key)
        if hit is not None:
            return hit
        schedule: Schedule | None = None
        error: str | None = None
        cached = self.disk_cache.load(key) if self.disk_cache is not None else None
        if isinstance(cached, Schedule):
            schedule = cached
            self.stats["schedules from disk cache"] += 1
        elif isinstance(cached, str):
            error = cached
        else:
            info = registry.get(name)
            kwargs: dict[str, object] = {"v": v, "memory_limit": resolve_limit(memory_limit, p)}
            if costs_key is not None:
                kwargs["costs"] = Costs(costs_key[0], costs_key[1], costs_key[2], None, costs_key[3])
            if unit is not None:
                kwargs["unit_size"] = unit
            if w_memory is not None:
                kwargs["w_memory"] = w_memory
            if objective is not None:
                kwargs["objective"] = objective
            started = time.perf_counter()
            try:
                schedule = info.build(p, m, **kwargs)
            except (ScheduleError, ValueError, TypeError) as exc:  # a generator's own argument checks
                error = first_line(exc)
            if self.disk_cache is not None and time.perf_counter() - started > DISK_CACHE_MIN_SECONDS:
                self.disk_cache.store(key, schedule if schedule is not None else error or "not applicable")
        if schedule is None:
            built = Built(None, None, error)
        else:
            try:
                lowered = validate(schedule)
            except ScheduleError as exc:
                built = Built(None, None, f"INVALID schedule generated (a bug): {first_line(exc)}")
            else:
                built = Built(schedule, lowered, None)
                self.stats["schedules built"] += 1
        self._built[key] = built
        return built

    def profile(self, key: tuple[Any, ...], schedule: Schedule, layout: Sequence[StageInfo]) -> ActivationProfile:
        """The activation profile of a built schedule over a layer layout, computed once per memo."""
        pkey = (key, tuple(i.activation_layers for i in layout), self.setup.w_retained_fraction)
        prof = self._profiles.get(pkey)
        if prof is None:
            prof = activation_profile(schedule, layout, self.setup.w_retained_fraction)
            self._profiles[pkey] = prof
        return prof

    def simulated_times(self, key: tuple[Any, ...], built: Built, costs: Costs) -> tuple[float, float, float]:
        """``(makespan, busy_max, span_max)`` in seconds."""
        assert built.schedule is not None and built.lowered is not None
        scale, ckey = normalise(costs, built.schedule.num_stages)
        overlap = self.overlap if built.schedule.overlap_pairs else 0.0  # only pairs are timed differently
        skey = (key, ckey, overlap) + (("post-validation",) if self.post_validation else ())  # memos are shared
        sim = self._sims.get(skey)
        if sim is None:
            f, b, w, c = ckey
            built.uses += 1
            if self.post_validation:  # iteration time = back-to-back time without the step synchronisation
                result = simulate(
                    built.schedule,
                    Costs(f, b, w, None, c),
                    lowered=built.lowered,
                    iterations=POST_VALIDATION_ITERATIONS,
                    post_validation=True,
                    overlap=overlap,
                    **SIM_KWARGS,
                )
                assert result.iterations is not None
                sim = Sim(result.iterations.time, max(result.busy), max(result.span))
            else:
                sim = simulate_once(built, f, b, w, c, overlap)
            self._sims[skey] = sim
            self.stats["simulations"] += 1
        else:
            self.stats["simulation cache hits"] += 1
        return sim.makespan * scale, sim.busy_max * scale, sim.span_max * scale

    # ---- evaluation -----------------------------------------------------------------------------
    def run(self, progress: bool | None = None, stream: TextIO | None = None) -> PlanResult:
        self.check_search()
        start = time.perf_counter()
        cpu_start = time.process_time()
        bar = Progress(self.count_steps(), progress, stream)
        rows: list[PlanRow] = []
        inapplicable: dict[str, Counter[str]] = {}
        over_best: dict[str, float] = {}
        evaluated = over = 0
        for t, p, d, b, m in self.shapes():
            for name in self.schedules_at(p):
                for limit in self.limits_at(p):
                    variants = schedule_variants(self, name, p, m, limit, t, d, b)
                    bar.update(1, f"{evaluated} configurations, {len(rows)} fit")
                    for item in variants:
                        if isinstance(item, str):
                            if limit is None:  # a schedule without a memory limit parameter refuses those
                                inapplicable.setdefault(name, Counter())[item] += 1
                            continue
                        shards = fsdp_options(name, t, d, self.model, self.space.fsdp or (False,))
                        if isinstance(shards, str):
                            inapplicable.setdefault(name, Counter())[shards] += 1
                            continue
                        for recompute in self.space.recompute:
                            for fsdp in shards:
                                evaluated += 1
                                for row in evaluate_layouts(self, item, t, p, d, b, m, recompute, fsdp):
                                    if isinstance(row, str):
                                        inapplicable.setdefault(name, Counter())[row] += 1
                                    elif isinstance(row, float):
                                        over += 1
                                        label = name + (f"@{limit}" if limit else "")
                                        over_best[label] = min(over_best.get(label, math.inf), row)
                                    else:
                                        rows.append(row)
        bar.close()
        rows.sort(key=lambda r: (-r.samples_per_second, r.peak_memory))
        for i, row in enumerate(rows, 1):
            row.rank = i
        return PlanResult(
            rows=rows,
            evaluated=evaluated,
            over_budget=over,
            over_budget_best=over_best,
            inapplicable=inapplicable,
            elapsed=time.perf_counter() - start,
            cpu=time.process_time() - cpu_start,
            stats={**self.stats, "FSDP simulations": self.fsdp_sim.simulations},
            budget_bytes=self.budget_bytes,
        )


# Work one search may do (:meth:`Planner.search_ops`): its distinct builds' ops, each times its generator's factor
# (:func:`build_factor`) plus BUILD_OVERHEAD, and each build's ops times the weight of its evaluations at every shape
# that uses it (:meth:`Planner.shape_evaluations`). Measured on the shared 2-core development machine, one run each
# (`OMP_NUM_THREADS=1 /usr/bin/time -f "%U user %M KB" megatron-pp plan ARGS --no-cache --top 1`, the limit lifted
# for the refused ones; 48x6144 = --num-layers 48 --hidden-size 6144 --num-attention-heads 48 --seq-length 2048):
#   estimate  user  peak MB  ARGS
#     0.17 M   2.0 s    56   --model tiny --gpus 8 --global-batch 64 --fsdp both
#     0.32 M   4.0 s    66   --model zb-6.2b --untie... --gpus 16 --global-batch 64 --tp 1 --schedules bfs,zeropp,1f1b
#                            --fsdp both --unit-sizes 1,2,4,8,32 (README)
#     0.96 M  14.1 s   128   --model llama3-70b --gpus 64 --global-batch 64 --device H100-80GB
#     1.55 M  13.9 s   230   --model zb-6.2b --gpus 8 --global-batch 96 --device A100-80GB (README)
#     1.74 M  25.9 s   253   --model llama3-70b --gpus 256 --global-batch 512 --device H100-80GB
#     1.92 M  28.9 s   557   --model zb-6.2b --gpus 16 --global-batch 1024 --schedules zeropp,1f1b,zb-h1
#                            --unit-sizes 4,16
#     2.44 M  24.6 s   328   --model zb-6.2b --gpus 16 --global-batch 512 --device A100-80GB --fsdp both --tp 1
#     2.49 M  25.5 s   394   --model llama3-70b --gpus 256 --global-batch 2048 --device H100-80GB --tp 8 --micro-batch 1
#     2.75 M  13.0 s   208   --model llama3-70b --gpus 64 --global-batch 512 ... --layer-split search (README)
#     3.47 M  36.4 s   772   --model zb-6.2b --gpus 8 --global-batch 512 --device A100-80GB
#     3.64 M  33.5 s   607   48x6144 --gpus 64 --global-batch 512 --device H100-80GB --distributed-optimizer
#                            --tp 8 (README)
#     4.36 M  38.6 s   588   --model llama3-70b --gpus 128 --global-batch 1024 --device H100-80GB --tp 8 (refused)
#     4.47 M  26.3 s   332   --model llama3-8b --gpus 8 --global-batch 128 --layer-split search (refused)
#     6.57 M  55.7 s  1492   --model zb-6.2b --gpus 32 --global-batch 2048 --device A100-80GB --tp 8 (refused)
# (more rows and the commands in benchmarks/RESULTS.md). From 9 to 15 s of CPU and at most 290 MB per M of estimate
# (the memo keeps every build; evaluations keep little): a search at the limit takes LIMIT_COST.
MAX_SEARCH_OPS = 3_700_000
LIMIT_COST = "at most about 1 minute of CPU and 1.1 GB, measured on 2 cores"
BUILD_OVERHEAD = 300
EVALUATION_WEIGHT = 0.06
PER_LAYER_EVALUATION_WEIGHT = 0.12
FSDP_EVALUATION_WEIGHT = 0.6
# zeropp's list scheduler picks, at every op, among the p ranks and the ceil(p / U) open units: per op about
# 6 + 0.14 p + 1.2 p / U us against about 6 us for a linear generator (single builds: p=8, m=256: U=1 16 us per op,
# U=64 6 us; p=64, m=512: U=1 93 us, U=256 15 us), i.e. a factor 1 + p / UNIT_RANKS + p / (UNIT_WINDOW x U)
UNIT_RANKS = 40
UNIT_WINDOW = 5
# greedy and searching generators per op against a linear one's ~5 us (single builds at p = 8 and 32, m = 3p, with
# validation and buffer counts: interleaved-zb 49-66 us, v-half 19-23, v-min 10-21, bitpipe-zb 9-20, zb-auto 13;
# 1f1b, interleaved-1f1b, zb-h1/h2, bfs, v-zb, dualpipev 2-7)
GENERATOR_FACTOR = {"interleaved-zb": 12.0, "v-half": 5.0, "v-min": 4.0, "bitpipe-zb": 4.0, "zb-auto": 3.0}


def builds_at(
    name: str, p: int, m: int, space: SearchSpace, feasible: list[int] | None = None
) -> set[tuple[object, ...]]:
    """At most the builds :func:`.variants.schedule_variants` makes for schedule ``name`` at ``(p, m)``, as
    ``(name, p, micro-batches, chunks, unit size, ops, weight)``: per chunk count tried, the extrapolation
    anchors (``m`` itself when not extrapolated), and for a schedule with unit sizes one build at ``m`` per unit
    size; only the chunk counts in ``feasible`` when given (those the layers split over). The weight is the op
    count times the generator's factor per op (:func:`build_factor`)."""
    info = registry.get(name)
    caps = info.capabilities
    if info.placement == "loop" and (caps is None or not caps.chunks.fixed):
        chunk_counts = {1, *space.virtual, caps.chunks.default if caps else 1}
    else:
        chunk_counts = {caps.chunks.default if caps is not None else 2}
    if feasible is not None:
        chunk_counts &= set(feasible)
    counts = anchor_counts(p, m)
    scans = info.takes("unit_size")
    units = [u for u in (space.unit_sizes or divisors(m)) if u < m and m % u == 0] if scans else []
    out: set[tuple[object, ...]] = set()
    for v in chunk_counts:
        for mm in counts:
            ops = OPS_PER_PAIR * p * v * mm
            out.add((name, p, mm, v, None, ops, round(ops * build_factor(name, p, mm if scans else None))))
        for u in units:
            ops = OPS_PER_PAIR * p * v * m
            out.add((name, p, m, v, u, ops, round(ops * build_factor(name, p, u))))
    return out


def build_factor(name: str, p: int, unit: int | None) -> float:
    """A build's cost per op relative to a linear generator's (generation, validation, lowering, buffer counts,
    compiled timing): the generator's own factor (:data:`GENERATOR_FACTOR`, 1 if not listed), and for zeropp at
    unit size ``unit`` (``m`` by default) ``1 + p / UNIT_RANKS + p / (UNIT_WINDOW x unit)``, since its list
    scheduler picks among the ``p`` ranks and the ``ceil(p / unit)`` open units at every op."""
    scan = 1.0 if unit is None else 1.0 + p / UNIT_RANKS + p / (UNIT_WINDOW * unit)
    return GENERATOR_FACTOR.get(name, 1.0) * scan


def no_shape_reason(planner: Planner) -> str:
    """Why no (TP, PP, DP, micro-batch) shape of the planner's GPUs and global batch divides."""
    model, n, batch = planner.model, planner.num_gpus, planner.global_batch
    per_node = planner.space.max_tp or planner.costs.device.gpus_per_node
    return (
        f"no configuration of {n} GPUs fits global batch {batch}: TP x PP x DP must be {n} with TP <= {per_node} "
        f"(one node) dividing the {model.num_attention_heads} heads, PP <= {2 * model.num_layers} (2 x "
        f"{model.num_layers} layers), and DP x micro-batch dividing the global batch"
        + (
            ""
            if planner.space.tp is None and planner.space.pp is None and planner.space.micro_batch is None
            else " (with the --tp / --pp / --micro-batch given)"
        )
        + ": give fewer --gpus or a larger --global-batch"
    )


class Progress:
    """A one-line progress bar on a terminal (silent otherwise unless forced)."""

    def __init__(self, total: int, enabled: bool | None = None, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = self.stream.isatty() if enabled is None else enabled
        self.total = max(1, total)
        self.done = 0
        self.start = time.perf_counter()
        self._last = 0.0

    def update(self, n: int = 1, note: str = "") -> None:
        self.done += n
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self._last < 0.1 and self.done < self.total:
            return
        self._last = now
        frac = min(1.0, self.done / self.total)
        width = 30
        bar = "#" * int(frac * width) + "." * (width - int(frac * width))
        self.stream.write(f"\r[{bar}] {self.done}/{self.total} {now - self.start:5.1f}s {note}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
