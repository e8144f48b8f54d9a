"""Grid search over (TP, PP, DP, micro-batch size, virtual stages, schedule, recompute).

For a model, a GPU count and a global batch, :class:`Planner` enumerates every configuration
whose shapes divide (``TP`` divides the heads and at most one node, ``TP*PP*DP = GPUs``,
``DP*micro_batch`` divides the global batch, the layers split over the schedule's stages), builds
the schedule with the registered generator (whatever is registered: a generator that refuses
``(p, m, v)`` makes the configuration inapplicable, with its reason), computes every rank's
memory (:mod:`.memory`) and drops configurations over the budget, then simulates the schedule
with per-stage costs (:mod:`.costs`) and ranks the rest by estimated throughput.

Speed: schedules, their validation and lowering, activation profiles and simulations are cached.
A simulation depends on costs only through their ratios (times scale), so it is cached by the
normalised costs (3 significant digits). For many micro-batches (``m > max(32, 4p)``) the schedule
is built, validated and simulated at three anchors ``m0 = 2p + (m mod p)``, ``m0 + p``, ``m0 + 2p``
only, and the makespan, busy time and per-rank peak activations are extrapolated linearly to ``m``
with the later slope when the two slopes agree within 5% (a peak that stopped growing keeps its
largest value);
otherwise (a greedy schedule whose cost is not affine in ``m``) the schedule is built and
simulated at ``m`` itself when ``m <= 8p``, and extrapolated anyway beyond (flagged ``approximate``,
``m~?`` in the table) since such a simulation can take seconds per configuration. The anchors have ``m``'s
residue modulo ``p``, so a generator's divisibility constraints hold for them; one that refuses an
anchor is simulated at ``m``. Layer splits are checked before any schedule is built.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import inspect
import io
import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

from ..analysis.simulate import Costs, simulate
from ..analysis.validate import validate
from ..argtypes import fraction, nonnegative_float, positive_float, positive_fraction, positive_int
from ..schedules import registry
from ..schedules.ir import ScheduleError
from ..schedules.lowering import LoweredSchedule
from ..schedules.schedule import Schedule
from .costs import CostModel, model_flops_per_iteration
from .dp_stream import ReductionProfile, exposed_dp_time, reduction_profile
from .fsdp import RUNTIME_NOTE, FsdpSimulator, fsdp_options
from .memory import (
    GIB,
    ActivationProfile,
    RankMemory,
    StageInfo,
    TrainingSetup,
    activation_profile,
    fsdp_rank_memory,
    rank_memory,
    split_layers,
    stage_layout,
    stage_parameters,
    w_memory_fraction,
)
from .models import ModelSpec
from .timing import TimingProgram

__all__ = ["Config", "PlanResult", "PlanRow", "Planner", "PlannerMemo", "SearchSpace", "divisors"]

EXACT_MIN = 32  # micro-batch counts up to max(EXACT_MIN, 4p) are simulated exactly
EXACT_FALLBACK = 8  # non-affine schedules are simulated at m itself up to m = 8p, approximated beyond
DISK_CACHE_MIN_SECONDS = 0.05  # only generators slower than this are worth a disk cache entry
COMPILE_AFTER = 2  # a schedule simulated this often gets a compiled TimingProgram (faster re-timing)


def _simulator_comm_model() -> str:
    """The simulator's default communication model (``async`` / ``blocking``; older simulators
    had only the blocking one)."""
    param = inspect.signature(simulate).parameters.get("comm")
    return str(param.default) if param is not None else "blocking"


SIM_COMM = _simulator_comm_model()
SIM_KWARGS: dict[str, Any] = {"comm": SIM_COMM} if "comm" in inspect.signature(simulate).parameters else {}
#: Back-to-back iterations timed per configuration with ``--post-validation`` (steady state).
POST_VALIDATION_ITERATIONS = 3
# overlap factor of a schedule's forward-and-backward pairs (dualpipev) when none is given: the simulator's
SIM_OVERLAP = float(inspect.signature(simulate).parameters["overlap"].default)


NO_PIPELINE = "none (pp=1)"  # how a configuration without pipeline parallelism is listed


def default_schedules() -> tuple[str, ...]:
    """Every registered schedule except ``v-block`` (which, without a block file, is ``v-half``)."""
    return tuple(n for n in registry.names() if n != "v-block")


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclass(frozen=True)
class SearchSpace:
    """Values to try; ``None`` means every valid value."""

    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    micro_batch: tuple[int, ...] | None = None  # default: powers of two up to 16 (and the preset's)
    virtual: tuple[int, ...] = (1, 2, 3, 4)  # chunks per rank to try for loop placements that take v
    recompute: tuple[str, ...] = ("none", "selective", "full")
    schedules: tuple[str, ...] | None = None  # default: every registered schedule
    memory_limits: tuple[str, ...] = ()  # extra memory limits ("p", "2p", "12") for memory-aware schedules
    layer_split: str = "auto"  # auto | even | embedding-loss
    max_tp: int | None = None  # default: GPUs per node
    fsdp: tuple[bool, ...] | None = None  # FSDP off / on per candidate (planner/fsdp.py); default: off only
    unit_sizes: tuple[int, ...] | None = None  # zeropp's unit sizes U; default: every divisor of m


@dataclass(frozen=True)
class Config:
    """One point of the grid."""

    schedule: str
    tp: int
    pp: int
    dp: int
    micro_batch: int
    num_microbatches: int
    chunks: int  # model chunks per rank (from the schedule's placement)
    placement: str
    recompute: str
    split: tuple[int, ...]  # layers per model slice
    v_flag: int | None = None  # megatron's virtual pipeline size to pass (None: schedule default)
    memory_limit: str | None = None
    costs_flag: str | None = None  # --pipeline-costs for cost-aware schedules
    unit_size: int | None = None  # --pipeline-unit-size (zeropp; None: the schedule's default)
    fsdp: bool = False  # --pipeline-fsdp

    @property
    def id(self) -> str:
        name = self.schedule + (f"@{self.memory_limit}" if self.memory_limit else "")
        return (
            f"{name}-t{self.tp}p{self.pp}d{self.dp}-b{self.micro_batch}m{self.num_microbatches}"
            f"-v{self.chunks}-{self.recompute}"
            + (f"-u{self.unit_size}" if self.unit_size is not None else "")
            + ("-fsdp" if self.fsdp else "")
        )

    @property
    def uneven(self) -> bool:
        return len(set(self.split)) > 1


@dataclass
class PlanRow:
    """A configuration that fits, with its estimates (times in seconds, memory in bytes)."""

    config: Config
    iteration_time: float
    pipeline_time: float  # simulated makespan of the schedule
    dp_time: float  # gradient reduction left after the pipeline (per-chunk reductions overlap, dp_stream.py)
    optimizer_time: float
    samples_per_second: float
    tokens_per_second_per_gpu: float
    tflops_per_gpu: float
    mfu: float
    bubble_rate: float  # zero-bubble paper's (longest per-rank span)
    sync_bubble_rate: float  # global makespan
    memory: list[RankMemory]
    extrapolated: bool = False
    approximate: bool = False  # extrapolated although the anchors were not on a line (m > 8p)
    rank: int = 0
    gathers: int = 0  # FSDP all-gathers per iteration (worst rank)

    @property
    def peak_memory(self) -> float:
        return max(m.total for m in self.memory)

    @property
    def peak_rank(self) -> int:
        return max(self.memory, key=lambda m: m.total).rank

    def to_json_dict(self, per_rank: bool = True) -> dict[str, Any]:
        c = self.config
        out: dict[str, Any] = {
            "rank": self.rank,
            "id": c.id,
            "schedule": c.schedule,
            "memory_limit": c.memory_limit,
            "tp": c.tp,
            "pp": c.pp,
            "dp": c.dp,
            "micro_batch": c.micro_batch,
            "num_microbatches": c.num_microbatches,
            "chunks": c.chunks,
            "placement": c.placement,
            "recompute": c.recompute,
            "layer_split": list(c.split),
            "iteration_time_s": round(self.iteration_time, 6),
            "pipeline_time_s": round(self.pipeline_time, 6),
            "dp_time_s": round(self.dp_time, 6),
            "optimizer_time_s": round(self.optimizer_time, 6),
            "samples_per_second": round(self.samples_per_second, 4),
            "tokens_per_second_per_gpu": round(self.tokens_per_second_per_gpu, 2),
            "tflops_per_gpu": round(self.tflops_per_gpu, 3),
            "mfu": round(self.mfu, 5),
            "bubble_rate": round(self.bubble_rate, 5),
            "sync_bubble_rate": round(self.sync_bubble_rate, 5),
            "peak_memory_gib": round(self.peak_memory / GIB, 3),
            "peak_memory_rank": self.peak_rank,
            "extrapolated": self.extrapolated,
            "approximate": self.approximate,
        }
        if c.unit_size is not None:
            out["unit_size"] = c.unit_size
        if c.fsdp:
            out["fsdp"] = True
            out["gathers_per_iteration"] = self.gathers
        if per_rank:
            out["memory_per_rank"] = [m.to_json_dict() for m in self.memory]
        return out


@dataclass
class PlanResult:
    rows: list[PlanRow]  # fitting configurations, best first
    evaluated: int  # configurations considered (after shape checks)
    over_budget: int
    over_budget_best: dict[str, float]  # schedule -> smallest peak memory seen (bytes) among those over
    inapplicable: dict[str, Counter[str]]  # schedule -> reason -> count
    elapsed: float
    cpu: float  # CPU seconds of this process (the machine may be shared)
    stats: dict[str, int]
    budget_bytes: float

    def best_per_schedule(self) -> list[PlanRow]:
        """Each schedule's best row; configurations without a pipeline (pp=1) are one group of their own."""
        seen: dict[str, PlanRow] = {}
        for row in self.rows:
            key = row.config.schedule + (f"@{row.config.memory_limit}" if row.config.memory_limit else "")
            key = NO_PIPELINE if row.config.pp == 1 else key
            if key not in seen:
                seen[key] = row
        return list(seen.values())


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


def _round_sig(x: float, digits: int = 3) -> float:
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - math.floor(math.log10(abs(x))))


def _normalise(costs: Costs, num_stages: int) -> tuple[float, tuple[Any, ...]]:
    """``(scale, key)``: costs divided by the largest forward time, rounded to 3 digits."""
    f, b, w, _ = costs.per_stage(num_stages)
    scale = max(f) or 1.0
    key = (
        tuple(_round_sig(x / scale) for x in f),
        tuple(_round_sig(x / scale) for x in b),
        tuple(_round_sig(x / scale) for x in w),
        _round_sig(float(costs.t_comm) / scale),
    )
    return scale, key


@dataclass
class _Sim:
    makespan: float  # in units of the normalisation scale
    busy_max: float
    span_max: float


@dataclass
class _Built:
    """A generated and validated schedule (or why it could not be)."""

    schedule: Schedule | None
    lowered: LoweredSchedule | None
    error: str | None
    timing: TimingProgram | None = None
    uses: int = 0
    starts: list[list[float]] | None = None  # op start times of its first simulation


@dataclass
class PlannerMemo:
    """What a :class:`Planner` computes that depends on the schedules and costs only, not on the model,
    device or budget: built and validated schedules, their activation profiles, simulations and
    reduction profiles. Planners given the same memo share it, so a schedule is built, validated and
    compiled once (``plan_spec`` over several global batches, ``grid --spec`` over several specs).
    Keys hold everything the value depends on; registering a schedule under a taken name does not
    happen (the registry refuses it), so the name identifies the generator."""

    built: dict[tuple[Any, ...], _Built] = field(default_factory=dict)
    profiles: dict[tuple[Any, ...], ActivationProfile] = field(default_factory=dict)
    sims: dict[tuple[Any, ...], _Sim] = field(default_factory=dict)
    reductions: dict[tuple[Any, ...], ReductionProfile] = field(default_factory=dict)


class ScheduleCache:
    """Generated schedules on disk (CSV), so that slow generators (greedy, cost-aware) run once per
    ``(name, p, m, v, memory limit, costs)`` across planner runs. Entries are keyed by a hash of the
    key and of every source file of ``megatron_pp_ext.schedules``: editing a generator invalidates
    them. A refusal is stored as its message."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.version = _schedules_source_hash()

    def _path(self, key: tuple[Any, ...]) -> Path:
        digest = hashlib.sha1(repr((self.version, key)).encode()).hexdigest()[:24]
        return self.dir / f"{key[0]}-p{key[1]}-m{key[2]}-{digest}"

    def load(self, key: tuple[Any, ...]) -> Schedule | str | None:
        base = self._path(key)
        try:
            if base.with_suffix(".csv").exists():
                return Schedule.from_csv(base.with_suffix(".csv").read_text(), source=str(base))
            if base.with_suffix(".err").exists():
                return base.with_suffix(".err").read_text().strip() or "not applicable"
        except (OSError, ScheduleError):
            return None
        return None

    def store(self, key: tuple[Any, ...], value: Schedule | str) -> None:
        base = self._path(key)
        try:
            if isinstance(value, Schedule):
                tmp = base.with_suffix(".tmp")
                tmp.write_text(value.to_csv())
                tmp.replace(base.with_suffix(".csv"))
            else:
                base.with_suffix(".err").write_text(value + "\n")
        except OSError:
            pass


def _schedules_source_hash() -> str:
    package = Path(registry.__file__).resolve().parent
    digest = hashlib.sha1()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megatron-pp" / "schedules"


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
        return sum(1 for _ in self.shapes()) * len(self.schedule_names) * (1 + len(self.space.memory_limits))

    # ---- schedules ------------------------------------------------------------------------------
    def _build(
        self,
        name: str,
        p: int,
        m: int,
        v: int | None,
        memory_limit: str | None,
        costs_key: tuple[float, ...] | None,
        unit: int | None = None,
    ) -> _Built:
        key = _build_key(name, p, m, v, memory_limit, costs_key, unit)
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
            kwargs: dict[str, object] = {"v": v, "memory_limit": _resolve_limit(memory_limit, p)}
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
                error = _first_line(exc)
            if self.disk_cache is not None and time.perf_counter() - started > DISK_CACHE_MIN_SECONDS:
                self.disk_cache.store(key, schedule if schedule is not None else error or "not applicable")
        if schedule is None:
            built = _Built(None, None, error)
        else:
            try:
                lowered = validate(schedule)
            except ScheduleError as exc:
                built = _Built(None, None, f"INVALID schedule generated (a bug): {_first_line(exc)}")
            else:
                built = _Built(schedule, lowered, None)
                self.stats["schedules built"] += 1
        self._built[key] = built
        return built

    def _profile(self, key: tuple[Any, ...], schedule: Schedule, layout: Sequence[StageInfo]) -> ActivationProfile:
        pkey = (key, tuple(i.layers for i in layout), self.setup.w_retained_fraction)
        prof = self._profiles.get(pkey)
        if prof is None:
            prof = activation_profile(schedule, layout, self.setup.w_retained_fraction)
            self._profiles[pkey] = prof
        return prof

    def _simulate(self, key: tuple[Any, ...], built: _Built, costs: Costs) -> tuple[float, float, float]:
        """``(makespan, busy_max, span_max)`` in seconds."""
        assert built.schedule is not None and built.lowered is not None
        scale, ckey = _normalise(costs, built.schedule.num_stages)
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
                    **SIM_KWARGS,
                    **({"overlap": overlap} if overlap else {}),
                )
                assert result.iterations is not None
                sim = _Sim(result.iterations.time, max(result.busy), max(result.span))
            else:
                sim = self._simulate_once(built, f, b, w, c, overlap)
            self._sims[skey] = sim
            self.stats["simulations"] += 1
        else:
            self.stats["simulation cache hits"] += 1
        return sim.makespan * scale, sim.busy_max * scale, sim.span_max * scale

    @staticmethod
    def _simulate_once(built: _Built, f: Any, b: Any, w: Any, c: float, overlap: float = 0.0) -> _Sim:
        """One iteration with a synchronous step; compiled once a schedule is timed often (the compiled
        program runs overlap pairs serially, so with an overlap factor the simulator times it)."""
        assert built.schedule is not None and built.lowered is not None
        if built.timing is None and built.uses >= COMPILE_AFTER and not overlap:
            built.timing = TimingProgram(built.lowered, SIM_COMM, built.starts)
            built.starts = None
        if built.timing is not None and not overlap:
            bw = tuple(x + y for x, y in zip(b, w, strict=True))
            timing = built.timing.run_tables((f, b, w, bw), c)
            return _Sim(timing.makespan, max(timing.busy), max(timing.span))
        kwargs = {**SIM_KWARGS, "overlap": overlap} if overlap else SIM_KWARGS
        result = simulate(built.schedule, Costs(f, b, w, None, c), lowered=built.lowered, **kwargs)
        if not overlap and min(min(f), min(b), min(w)) > 0:  # its start times order the ops topologically
            built.starts = result.starts
        return _Sim(result.makespan, max(result.busy), max(result.span))

    # ---- evaluation -----------------------------------------------------------------------------
    def run(self, progress: bool | None = None, stream: TextIO | None = None) -> PlanResult:
        start = time.perf_counter()
        cpu_start = time.process_time()
        bar = Progress(self.count_steps(), progress, stream)
        rows: list[PlanRow] = []
        inapplicable: dict[str, Counter[str]] = {}
        over_best: dict[str, float] = {}
        evaluated = over = 0
        for t, p, d, b, m in self.shapes():
            for name in self.schedule_names:
                for limit in (None, *self.space.memory_limits):
                    variants = self._variants(name, p, m, limit, t, d, b)
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
                                row = self._evaluate(item, t, p, d, b, m, recompute, fsdp)
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

    def _anchors(self, p: int, m: int) -> list[int]:
        """Micro-batch counts to simulate for ``m``: ``[m]``, or two anchors to extrapolate from
        (``m0`` in ``[2p, 3p)`` with ``m0 = m (mod p)``, ``m0 + p`` and ``m0 + 2p``)."""
        m0 = 2 * p + (m % p)
        if m <= max(EXACT_MIN, 4 * p) or m0 + 2 * p >= m:
            return [m]
        return [m0, m0 + p, m0 + 2 * p]

    def _feasible_chunks(self, style: str, p: int) -> list[int] | None:
        """Chunk counts whose stages the layers split over (``None``: any, the style is unknown)."""
        layers = self.model.num_layers
        if style in ("v", "bidirectional"):  # megatron's uneven-stage options apply to their slices too
            return [2] if split_layers(layers, 2 * p, self.space.layer_split) is not None else []
        if style == "loop":
            options = sorted({1, *self.space.virtual})
            return [c for c in options if split_layers(layers, p * c, self.space.layer_split) is not None]
        return None

    def _variants(self, name: str, p: int, m: int, limit: str | None, t: int, d: int, b: int) -> list[_Variant | str]:
        """The chunk-count variants of schedule ``name`` at ``(p, m)``, or the reasons why not."""
        info = registry.get(name)
        feasible = self._feasible_chunks(info.placement, p)
        if feasible == []:
            stages = 2 * p if info.placement in ("v", "bidirectional") else p
            return [
                f"{self.model.num_layers} layers do not split over the stages of a {info.placement} placement "
                f"on {p} ranks ({stages}{'' if info.placement != 'loop' else ' x chunks'})"
            ]
        costs_key = self._generator_costs(t, p, d, b) if info.takes("costs") else None
        anchors = self._anchors(p, m)

        def build_all(v: int | None) -> list[tuple[int, _Built, tuple[Any, ...]]] | str:
            out = []
            for mm in anchors:
                built = self._build(name, p, mm, v, limit, costs_key)
                if built.schedule is None and mm != m:  # an anchor refused: judge (and name) the real m
                    built, mm = self._build(name, p, m, v, limit, costs_key), m
                    if built.schedule is not None:
                        return [(m, built, (name, p, m, v, limit, costs_key))]
                if built.schedule is None:
                    return _short(built.error)
                out.append((mm, built, (name, p, mm, v, limit, costs_key)))
            return out

        base = build_all(None)
        if isinstance(base, str):
            return [base]
        first = base[0][1].schedule
        assert first is not None
        default_chunks = first.chunks_per_rank
        options: list[tuple[int | None, list[tuple[int, _Built, tuple[Any, ...]]]]] = [(None, base)]
        if first.placement.style == "loop":
            declared = info.capabilities
            for v in self.space.virtual:
                if v == default_chunks or (feasible is not None and v not in feasible):
                    continue
                if declared is not None and not declared.chunks.accepts(v):
                    continue  # the schedule declares it does not run v chunks
                builds = build_all(v)
                if not isinstance(builds, str):
                    options.append((v, builds))
        out: list[_Variant | str] = []
        for v, builds in options:
            sched = builds[-1][1].schedule
            assert sched is not None
            placement = sched.placement
            chunks = sched.chunks_per_rank
            if v is None and placement.style == "loop" and chunks not in self.space.virtual:
                continue
            split = split_layers(self.model.num_layers, placement.stages_per_replica, self.space.layer_split)
            if split is None:
                out.append(
                    f"{self.model.num_layers} layers do not split over {placement.stages_per_replica} stages "
                    f"({placement.style} placement, {chunks} chunk(s) per rank)"
                )
                continue
            out.append(_Variant(name, v, limit, costs_key, chunks, tuple(split), sched, builds))
        if not out:
            out.append(f"no chunk count in {self.space.virtual} applies")
        if info.takes("unit_size"):
            return self._unit_variants(out, name, p, m, limit, costs_key)
        return out

    def _unit_variants(
        self,
        variants: list[_Variant | str],
        name: str,
        p: int,
        m: int,
        limit: str | None,
        costs_key: tuple[float, ...] | None,
    ) -> list[_Variant | str]:
        """Each variant once per unit size ``U`` (``SearchSpace.unit_sizes``, default every divisor of
        ``m``): ``U = m`` is the schedule's default (simulated at the anchors), any other ``U`` is
        built and simulated at ``m`` itself (its units do not scale with the anchors)."""
        sizes = [u for u in (self.space.unit_sizes or divisors(m)) if 1 <= u <= m and m % u == 0]
        out: list[_Variant | str] = []
        for var in variants:
            if isinstance(var, str):
                out.append(var)
                continue
            for unit in sizes:
                if unit == m:
                    out.append(replace(var, unit=m))
                    continue
                built = self._build(name, p, m, var.v, limit, costs_key, unit)
                if built.schedule is None:
                    out.append(_short(built.error))
                    continue
                key = _build_key(name, p, m, var.v, limit, costs_key, unit)
                out.append(replace(var, unit=unit, unit_arg=unit, schedule=built.schedule, builds=[(m, built, key)]))
        if not out:
            out.append(f"no unit size divides m={m} in {self.space.unit_sizes}")
        return out

    def _generator_costs(self, t: int, p: int, d: int, b: int) -> tuple[float, float, float, float]:
        """Relative ``F, B, W, COMM`` of an average stage (what ``--pipeline-costs`` passes), rounded
        so that cost-aware generators are rebuilt only when the ratios really change."""
        lt = self.costs.layer_times(b, t, "none")
        cf, cb = self.costs.tp_comm_per_layer(b, t)
        f, bb, w = lt.f + cf, lt.b + cb, lt.w
        comm = self.costs.p2p_time(b, t, p, d)
        layers = max(1.0, self.model.num_layers / p)
        return (1.0, round(bb / f, 1), round(w / f, 1), _quantise_comm(comm / (f * layers)))

    def _exact(self, var: _Variant, p: int, m: int) -> list[tuple[int, _Built, tuple[Any, ...]]] | str:
        key = _build_key(var.name, p, m, var.v, var.limit, var.costs_key, var.unit_arg)
        built = self._build(var.name, p, m, var.v, var.limit, var.costs_key, var.unit_arg)
        if built.schedule is None:
            return _short(built.error)
        self.stats["exact fallbacks"] += 1
        return [(m, built, key)]

    def _memory(
        self,
        builds: Sequence[tuple[int, _Built, tuple[Any, ...]]],
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
            prof = self._profile(key, built.schedule, layout)
            mems.append(
                rank_memory(
                    self.model,
                    self.setup,
                    tensor_parallel=t,
                    data_parallel=d,
                    micro_batch=b,
                    recompute=recompute,
                    schedule=built.schedule,
                    split=split,
                    profile=prof,
                )
            )
        if len(builds) == 1:
            return mems[0]
        ms = [mm for mm, _, _ in builds]
        out = []
        for per_anchor in zip(*mems, strict=True):
            acts = [r.activations for r in per_anchor]
            value = _affine_at(ms, acts, m, math.inf if force else 0.05)
            if value is None:
                return None
            last = per_anchor[-1]
            out.append(
                RankMemory(
                    rank=last.rank,
                    parameters=last.parameters,
                    weights=last.weights,
                    gradients=last.gradients,
                    optimizer=last.optimizer,
                    activations=max(value, last.activations),
                    transient=last.transient,
                )
            )
        return out

    def _times(
        self, builds: Sequence[tuple[int, _Built, tuple[Any, ...]]], costs: Costs, m: int, force: bool = False
    ) -> tuple[float, float, float] | None:
        """``(makespan, busy, span)`` at ``m`` (extrapolated; ``None`` if not affine)."""
        sims = [self._simulate(key, built, costs) for _, built, key in builds]
        if len(sims) == 1:
            return sims[0]
        ms = [mm for mm, _, _ in builds]
        values = [_affine_at(ms, [s[i] for s in sims], m, math.inf if force else 0.05) for i in range(3)]
        if any(v is None for v in values):
            return None
        makespan, busy, span = (float(v) for v in values)  # type: ignore[arg-type]
        return makespan, busy, span

    def _exposed_dp(
        self,
        builds: Sequence[tuple[int, _Built, tuple[Any, ...]]],
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
            chunk_time.append(
                {info.stage: total * (info.layers / layers if layers else 1 / len(mine)) for info in mine}
            )
        values = []
        for _, built, key in builds:
            assert built.schedule is not None
            profile = self._reductions.get(key)
            if profile is None:
                profile = self._reductions[key] = reduction_profile(built.schedule)
            values.append(exposed_dp_time(profile, tables, chunk_time))
        if len(values) == 1:
            return values[0]
        value = _affine_at([mm for mm, _, _ in builds], values, m, math.inf)
        return min(max(0.0, float(values[-1] if value is None else value)), max(per_rank, default=0.0))

    def _evaluate(
        self, var: _Variant, t: int, p: int, d: int, b: int, m: int, recompute: str, fsdp: bool = False
    ) -> PlanRow | float | str:
        """A row, the worst rank's memory (bytes) if over the budget, or why ``m`` itself is refused.
        ``fsdp``: parameters sharded inside the pipeline (memory and time from planner/fsdp.py)."""
        schedule = var.schedule
        layout = stage_layout(schedule.placement, var.split)
        builds = var.builds
        approximate = False
        memory = self._memory(builds, layout, var.split, t, d, b, recompute, m)
        if memory is None:  # peaks not affine in m: this schedule's memory needs the real m
            if m > EXACT_FALLBACK * p:  # too long to simulate: extrapolate anyway, marked approximate
                approximate = True
                memory = self._memory(builds, layout, var.split, t, d, b, recompute, m, force=True)
            else:
                builds = self._exact(var, p, m)
                if isinstance(builds, str):
                    return builds
                memory = self._memory(builds, layout, var.split, t, d, b, recompute, m)
            assert memory is not None
        stage_params: list[float] = []
        if fsdp:
            _, last_built, last_key = builds[-1]
            assert last_built.schedule is not None
            stage_params = stage_parameters(self.model, t, layout)
            plan = self.fsdp_sim.plan(last_key, last_built.schedule)
            memory = fsdp_rank_memory(self.setup, d, plan, stage_params, memory)
        worst = max(mem.total for mem in memory)
        if worst > self.budget_bytes:
            return worst
        costs = self.costs.stage_costs(
            layout, micro_batch=b, tensor_parallel=t, pipeline=p, data_parallel=d, recompute=recompute
        )
        times = self._times(builds, costs, m)
        if times is None:  # makespan not affine in m (a greedy schedule): simulate the real m
            if m > EXACT_FALLBACK * p:
                approximate = True
                times = self._times(builds, costs, m, force=True)
            else:
                builds = self._exact(var, p, m)
                if isinstance(builds, str):
                    return builds
                times = self._times(builds, costs, m)
            assert times is not None
        makespan, busy, span = times
        extrapolated = len(builds) > 1
        params = [mem.parameters for mem in memory]
        gathers = 0
        if fsdp:
            dp_time, gathers = self._fsdp_time(builds, costs, stage_params, t, d, m, makespan)
            opt_time = max(self.costs.optimizer_time(n / d, 1) for n in params)  # each rank updates its shard
        else:
            per_rank = [self.costs.dp_time(n, t, d) for n in params]
            if schedule.placement.num_replicas == 2:  # a chunk's replica sum precedes its data-parallel reduction
                per_rank = [x + self.costs.replica_sync_time(n, t, p, d) for x, n in zip(per_rank, params, strict=True)]
            dp_time = self._exposed_dp(builds, layout, costs, per_rank, m)
            opt_time = max(self.costs.optimizer_time(n, d) for n in params)
        iteration = makespan + dp_time + opt_time
        flops = model_flops_per_iteration(self.model, self.global_batch)
        peak = self.costs.device.tflops(self.setup.precision) * 1e12
        samples = self.global_batch / iteration
        config = Config(
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
        )
        return PlanRow(
            config=config,
            iteration_time=iteration,
            pipeline_time=makespan,
            dp_time=dp_time,
            optimizer_time=opt_time,
            samples_per_second=samples,
            tokens_per_second_per_gpu=samples * self.model.seq_length / self.num_gpus,
            tflops_per_gpu=flops / (iteration * self.num_gpus) / 1e12,
            mfu=flops / (iteration * self.num_gpus * peak),
            bubble_rate=max(0.0, (span - busy) / span) if span > 0 else 0.0,
            sync_bubble_rate=max(0.0, (makespan - busy) / makespan) if makespan > 0 else 0.0,
            memory=memory,
            extrapolated=extrapolated,
            approximate=approximate,
            gathers=gathers,
        )

    def _fsdp_time(
        self,
        builds: Sequence[tuple[int, _Built, tuple[Any, ...]]],
        costs: Costs,
        stage_params: Sequence[float],
        t: int,
        d: int,
        m: int,
        makespan: float,
    ) -> tuple[float, int]:
        """``(exposed FSDP time, gathers per iteration)`` at ``m``: the simulator's iteration with its
        data-parallel stream minus the compute-only makespan (extrapolated from the anchors)."""
        stage_bytes = [n * self.setup.param_bytes for n in stage_params]
        bandwidth = self.costs.dp_bandwidth(t, d)
        timings = []
        for _, built, key in builds:
            assert built.schedule is not None and built.lowered is not None
            timings.append(self.fsdp_sim.time(key, built.schedule, built.lowered, costs, stage_bytes, d, bandwidth))
        if len(timings) == 1:
            iteration, gathers = timings[0].iteration, timings[0].gathers
        else:
            ms = [mm for mm, _, _ in builds]
            iteration = float(_affine_at(ms, [x.iteration for x in timings], m, math.inf) or timings[-1].iteration)
            gathers = round(_affine_at(ms, [float(x.gathers) for x in timings], m, math.inf) or timings[-1].gathers)
        return max(0.0, iteration - makespan), int(gathers)


def _build_key(
    name: str,
    p: int,
    m: int,
    v: int | None,
    limit: str | None,
    costs_key: tuple[float, ...] | None,
    unit: int | None = None,
) -> tuple[Any, ...]:
    """A generated schedule's cache key (the unit size only when one is given)."""
    return (name, p, m, v, limit, costs_key) + ((unit,) if unit is not None else ())


@dataclass
class _Variant:
    name: str
    v: int | None  # the v passed to the generator (None: its default)
    limit: str | None
    costs_key: tuple[float, ...] | None
    chunks: int
    split: tuple[int, ...]
    schedule: Schedule  # the largest simulated one (placement, chunks)
    builds: list[tuple[int, _Built, tuple[Any, ...]]]  # (m, validated schedule, cache key): 1 or 2 anchors
    unit: int | None = None  # unit size U of the row (zeropp), None for schedules without one
    unit_arg: int | None = None  # the unit size passed to the generator (None: its default, U = m)


def _affine_at(xs: Sequence[int], ys: Sequence[float], x: int, tolerance: float = 0.05) -> float | None:
    """Extrapolate ``ys(xs)`` to ``x`` with the slope of the last two points, or ``None`` when the
    earlier slope differs from it by more than ``tolerance`` (relative): the values do not grow
    linearly (yet). A last slope <= 0 (a saturated memory peak, or a greedy schedule that keeps
    less alive with more micro-batches) gives the largest value seen, conservatively."""
    slopes = [(ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i]) for i in range(len(xs) - 1)]
    last = slopes[-1]
    if last <= 0:
        return max(ys)
    if any(abs(a - last) > tolerance * abs(last) for a in slopes):
        return None
    return ys[-1] + last * (x - xs[-1])


_COMM_STEPS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


def _quantise_comm(ratio: float) -> float:
    """The nearest of a few relative p2p costs (a cost-aware generator is rebuilt per distinct
    value; its order barely changes between neighbours)."""
    return min(_COMM_STEPS, key=lambda x: abs(x - ratio))


def _resolve_limit(limit: str | None, p: int) -> float | int | None:
    if limit is None:
        return None
    text = str(limit).strip().lower()
    value = float(text[:-1] or 1) * p if text.endswith("p") else float(text)
    return int(value) if value.is_integer() else value


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def _short(reason: str | None, limit: int = 160) -> str:
    text = reason or "not applicable"
    # Numbers differ per configuration; keep the reason readable and groupable.
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---- Megatron flags of a configuration ---------------------------------------------------------------
def config_args(config: Config, setup: TrainingSetup, global_batch: int) -> list[str]:
    """The parallelism / schedule / memory flags of ``scripts/pretrain_gpt.py`` for ``config``."""
    args = [
        "--tensor-model-parallel-size",
        str(config.tp),
        "--pipeline-model-parallel-size",
        str(config.pp),
        "--micro-batch-size",
        str(config.micro_batch),
        "--global-batch-size",
        str(global_batch),
        "--pipeline-schedule",
        config.schedule,
    ]
    if config.v_flag is not None and config.chunks > 1:
        args += ["--num-virtual-stages-per-pipeline-rank", str(config.chunks)]
    if config.memory_limit:
        args += ["--pipeline-memory-limit", config.memory_limit]
    if config.costs_flag:
        args += ["--pipeline-costs", config.costs_flag]
    if config.unit_size is not None:
        args += ["--pipeline-unit-size", str(config.unit_size)]
    if config.fsdp:
        args.append("--pipeline-fsdp")
    if config.uneven:
        args += ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
    if setup.uses_sp(config.tp):
        args.append("--sequence-parallel")
    if setup.distributed_optimizer and not config.fsdp:  # FSDP shards the optimizer state itself
        args.append("--use-distributed-optimizer")
    if config.recompute == "selective":
        args += ["--recompute-granularity", "selective"]
    elif config.recompute == "full":
        args += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    return args


def precision_args(setup: TrainingSetup) -> list[str]:
    return {"bf16": ["--bf16"], "fp16": ["--fp16"], "fp32": []}[setup.precision]


def model_args(model: ModelSpec) -> list[str]:
    """Model shape flags plus the mock-data tokenizer that gives the model's vocabulary."""
    return [*model.megatron_args(), "--tokenizer-type", "NullTokenizer", "--vocab-size", str(model.vocab_size)]


# ---- one configuration's memory (for checks and docs) ------------------------------------------------
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


# ---- presentation --------------------------------------------------------------------------------------
TABLE_HEADER = (
    "#",
    "schedule",
    "tp",
    "pp",
    "dp",
    "mb",
    "m",
    "v",
    "recompute",
    "iter s",
    "samples/s",
    "tok/s/GPU",
    "TFLOP/s/GPU",
    "MFU",
    "peak GiB (rank)",
    "bubble",
    "sync bubble",
    "fsdp",
    "gathers",
    "DP exposed ms",
)


def row_label(config: Config) -> str:
    """A row's schedule as the table shows it: name, ``@memory limit``, ``/U`` unit size."""
    if config.pp == 1:
        return NO_PIPELINE
    label = config.schedule + (f"@{config.memory_limit}" if config.memory_limit else "")
    return label + (f"/U{config.unit_size}" if config.unit_size is not None else "")


def table_rows(rows: Sequence[PlanRow]) -> list[list[str]]:
    out = []
    for r in rows:
        c = r.config
        out.append(
            [
                str(r.rank),
                row_label(c),
                str(c.tp),
                str(c.pp),
                str(c.dp),
                str(c.micro_batch),
                str(c.num_microbatches) + ("~?" if r.approximate else "~" if r.extrapolated else ""),
                str(c.chunks),
                c.recompute,
                f"{r.iteration_time:.4g}",
                f"{r.samples_per_second:.4g}",
                f"{r.tokens_per_second_per_gpu:.5g}",
                f"{r.tflops_per_gpu:.4g}",
                f"{100 * r.mfu:.1f}%",
                f"{r.peak_memory / GIB:.1f} ({r.peak_rank})",
                f"{r.bubble_rate:.4f}",
                f"{r.sync_bubble_rate:.4f}",
                "fsdp" if c.fsdp else "-",
                str(r.gathers) if c.fsdp else "-",
                f"{r.dp_time * 1e3:.3g}",
            ]
        )
    return out


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    cells = [list(header), *[list(r) for r in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary_lines(result: PlanResult, planner: Planner) -> list[str]:
    lines = [
        f"searched {result.evaluated} configurations in {result.elapsed:.1f} s ({result.cpu:.1f} s CPU; "
        f"{result.stats.get('schedules built', 0)} schedules built, "
        f"{result.stats.get('simulations', 0)} simulations); "
        f"{len(result.rows)} fit in {result.budget_bytes / GIB:.1f} GiB, {result.over_budget} over budget",
        f"model {planner.model.name} ({planner.model.num_parameters() / 1e9:.2f}B parameters), "
        f"{planner.num_gpus} GPUs, global batch {planner.global_batch}; {planner.costs.describe()}",
        "m~ = extrapolated from three shorter simulations (m~? = approximately); peak = worst rank's weights + grads + "
        "optimizer + activations; bubble = zero-bubble paper's (per-rank span), sync bubble = global makespan; "
        "DP exposed = data-parallel time the iteration adds after the pipeline (fsdp: gather stalls + reduce drain, "
        "simulated; /U = zeropp's unit size",
    ]
    if any(r.config.fsdp for r in result.rows):
        lines.append(RUNTIME_NOTE)
    fitting = {r.config.schedule + (f"@{r.config.memory_limit}" if r.config.memory_limit else "") for r in result.rows}
    for label, peak in sorted(result.over_budget_best.items()):
        if label not in fitting:
            lines.append(f"  {label}: every configuration over budget (smallest needs {peak / GIB:.1f} GiB)")
    for name, reasons in sorted(result.inapplicable.items()):
        top = reasons.most_common(2)
        shown = "; ".join(f"{why} (x{n})" for why, n in top)
        lines.append(f"  {name}: {sum(reasons.values())} shape(s) not applicable: {shown}")
    return lines


def plan_document(result: PlanResult, planner: Planner, rows: Sequence[PlanRow]) -> dict[str, Any]:
    """The JSON a plan is saved as (``--save``; read by ``grid``, ``launch-local`` and ``collect``)."""
    from dataclasses import asdict

    setup = planner.setup
    docs = []
    for row in rows:
        entry = row.to_json_dict()
        entry["megatron_args"] = config_args(row.config, setup, planner.global_batch)
        docs.append(entry)
    doc = {
        "format": "megatron-pp plan v1",
        "model": asdict(planner.model),
        "gpus": planner.num_gpus,
        "global_batch": planner.global_batch,
        "device": planner.costs.device.name,
        "gpus_per_node": planner.costs.device.gpus_per_node,
        "setup": asdict(setup),
        "model_args": model_args(planner.model),
        "precision_args": precision_args(setup),
        "memory_budget_gib": round(result.budget_bytes / GIB, 3),
        "searched": result.evaluated,
        "rows": docs,
    }
    if planner.overlap != SIM_OVERLAP:  # only when given (the provided plans predate the flag)
        doc["overlap"] = planner.overlap
    return doc


# ---- command line ----------------------------------------------------------------------------------
def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def _str_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in str(text).split(",") if x.strip())


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """The model / cluster / search flags shared by ``plan``, ``grid`` and ``launch-local``."""
    g = parser.add_argument_group("model (a preset, or explicit shapes; explicit flags override a preset)")
    g.add_argument("--model", help="model preset (see --list-models)")
    g.add_argument("--list-models", action="store_true", help="print the model presets and exit")
    g.add_argument("--num-layers", type=positive_int)
    g.add_argument("--hidden-size", type=positive_int)
    g.add_argument("--num-attention-heads", type=positive_int)
    g.add_argument("--seq-length", type=positive_int)
    g.add_argument("--vocab-size", type=positive_int)
    g.add_argument("--ffn-hidden-size", type=positive_int)
    g.add_argument("--num-query-groups", type=positive_int, help="grouped-query attention groups")
    g.add_argument("--swiglu", action="store_true", default=None)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None)
    c = parser.add_argument_group("cluster and training")
    c.add_argument("--gpus", type=positive_int, help="number of GPUs (default: the preset's)")
    c.add_argument("--global-batch", type=positive_int, help="global batch size in sequences (default: the preset's)")
    c.add_argument("--device", default="A100-80GB", help="device preset: A100-80GB, H100-80GB, H200, V100-32GB, CPU")
    c.add_argument("--gpus-per-node", type=positive_int, help="GPUs per node (default: the device preset's, 8)")
    c.add_argument("--memory-budget", type=positive_float, help="GiB per GPU (default: the device's memory)")
    c.add_argument(
        "--memory-reserve", type=nonnegative_float, default=2.0, help="GiB kept free (CUDA context, NCCL, ...)"
    )
    c.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default=None, help="default bf16 (fp32 on CPU)")
    c.add_argument("--distributed-optimizer", action="store_true", help="Megatron's --use-distributed-optimizer")
    c.add_argument("--no-sequence-parallel", action="store_true", help="do not use sequence parallelism with TP")
    c.add_argument("--attention", choices=("flash", "unfused"), default=None, help="default flash (unfused on CPU)")
    c.add_argument(
        "--efficiency", type=positive_fraction, help="share of peak FLOP/s large GEMMs reach (default: device's)"
    )
    c.add_argument("--dp-overlap", type=fraction, default=0.0, help="share of the DP gradient reduction hidden")
    c.add_argument(
        "--overlap",
        type=fraction,
        default=SIM_OVERLAP,
        metavar="F",
        help="overlap factor of forward-and-backward pairs (dualpipev), as in simulate: a pair takes "
        "max + (1-F) x min; default %(default)g = one after the other",
    )
    c.add_argument(
        "--w-retained", type=fraction, default=1.0, help="share of an activation a B keeps until its W (1.0 = papers')"
    )
    c.add_argument(
        "--post-validation",
        action="store_true",
        help="optimizer post-validation (no synchronisation before the step): an iteration takes the simulated "
        "back-to-back time per iteration, and zb-auto minimises it (--objective span)",
    )
    c.add_argument(
        "--w-memory",
        type=_w_memory_arg,
        default=None,
        metavar="auto|FRACTION",
        help="share of an activation a pending W keeps, in (0, 1]; 'auto' derives it from the model shape, "
        "attention and recompute setting (zero-bubble paper Table 1: M_W/M_B); sets --w-retained and "
        "zb-auto's memory accounting (default: --w-retained, zb-auto counting whole activations)",
    )
    s = parser.add_argument_group("search space (comma-separated lists; default: everything valid)")
    s.add_argument(
        "--schedules",
        type=_str_list,
        help="schedules to consider (default: every registered one); 'auto': every one with the memory limits "
        "p and 2p too, and print the auto decision table (what --pipeline-schedule auto picks)",
    )
    s.add_argument("--tp", type=_int_list)
    s.add_argument("--pp", type=_int_list)
    s.add_argument("--micro-batch", type=_int_list, help="default 1,2,4,8,16 (and the preset's)")
    s.add_argument("--virtual", type=_int_list, default=(1, 2, 3, 4), help="chunks per rank for loop placements")
    s.add_argument("--recompute", type=_str_list, default=("none", "selective", "full"))
    s.add_argument("--schedule-memory-limits", type=_str_list, default=(), help="also try these (e.g. p,2p)")
    s.add_argument(
        "--fsdp",
        choices=("off", "on", "both"),
        default=None,
        help="FSDP inside the pipeline (--pipeline-fsdp) per candidate, for schedules that declare it (TP=1, untied "
        "embeddings, DP >= 2): off (default; 'both' with --schedules auto), on (only sharded rows where allowed), both",
    )
    s.add_argument("--unit-sizes", type=_int_list, help="zeropp unit sizes U to try (default: every divisor of m)")
    s.add_argument("--layer-split", choices=("auto", "even", "embedding-loss"), default="auto")
    s.add_argument(
        "--cache",
        default=str(default_cache_dir()),
        help="directory caching slow schedule generators' output across runs (default %(default)s)",
    )
    s.add_argument("--no-cache", action="store_true", help="do not read or write the schedule cache")


_FSDP_CHOICES = {"off": (False,), "on": (True,), "both": (False, True)}


def planner_from_args(args: argparse.Namespace, memo: PlannerMemo | None = None) -> Planner:
    from .costs import get_device
    from .models import ModelSpec, get_model

    shapes = {
        "num_layers": args.num_layers,
        "hidden_size": args.hidden_size,
        "num_attention_heads": args.num_attention_heads,
        "seq_length": args.seq_length,
        "vocab_size": args.vocab_size,
        "ffn_hidden_size": args.ffn_hidden_size,
        "num_query_groups": args.num_query_groups,
        "swiglu": args.swiglu,
        "untie_embeddings_and_output_weights": args.untie_embeddings_and_output_weights,
    }
    if args.model:
        model = get_model(args.model)
        if any(v is not None for v in shapes.values()):
            model = model.with_overrides(name=f"{model.name}-custom", assumed=(), **shapes)
    else:
        missing = [
            f"--{k.replace('_', '-')}"
            for k in ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
            if shapes[k] is None
        ]
        if missing:
            raise ValueError(f"give --model PRESET or the model shape ({', '.join(missing)} missing)")
        model = ModelSpec("custom", **{k: v for k, v in shapes.items() if v is not None})  # type: ignore[arg-type]
    device = get_device(args.device)
    if args.gpus_per_node:
        device = replace(device, gpus_per_node=args.gpus_per_node)
    cpu = device.name == "CPU"
    setup = TrainingSetup(
        precision=args.precision or ("fp32" if cpu else "bf16"),
        distributed_optimizer=args.distributed_optimizer,
        sequence_parallel=not args.no_sequence_parallel,
        attention=args.attention or ("unfused" if cpu else "flash"),
        w_retained_fraction=args.w_retained,
    )
    w_memory = getattr(args, "w_memory", None)
    if w_memory == "auto":  # one share per plan: the smallest TP searched, the first recompute setting
        w_memory = w_memory_fraction(model, min(args.tp or (1,)), setup, (args.recompute or ("none",))[0])
    if w_memory is not None:
        setup = replace(setup, w_retained_fraction=float(w_memory))
    cost_model = CostModel(model, device, setup, efficiency=args.efficiency, dp_overlap=args.dp_overlap)
    gpus = args.gpus or model.default_gpus
    batch = args.global_batch or model.default_global_batch
    if not gpus or not batch:
        raise ValueError(f"model {model.name} has no default GPU count / global batch: give --gpus and --global-batch")
    for r in args.recompute:
        if r not in ("none", "selective", "full"):
            raise ValueError(f"--recompute values must be none, selective or full, got {r!r}")
    auto = tuple(args.schedules or ()) == ("auto",)
    space = SearchSpace(
        tp=args.tp,
        pp=args.pp,
        micro_batch=args.micro_batch,
        virtual=tuple(args.virtual),
        recompute=tuple(args.recompute),
        schedules=None if auto else args.schedules,
        memory_limits=tuple(args.schedule_memory_limits),
        layer_split=args.layer_split,
        fsdp=_FSDP_CHOICES[args.fsdp] if getattr(args, "fsdp", None) else None,
        unit_sizes=getattr(args, "unit_sizes", None),
    )
    if auto:  # every schedule and parameter (planner/auto.py)
        from .auto import auto_space

        space = auto_space(space)
    return Planner(
        model,
        gpus,
        batch,
        cost_model,
        memory_budget_gib=args.memory_budget,
        memory_reserve_gib=args.memory_reserve,
        space=space,
        cache_dir=None if args.no_cache else args.cache,
        w_memory=None if w_memory is None else float(w_memory),
        post_validation=bool(getattr(args, "post_validation", False)),
        memo=memo,
        overlap=args.overlap,
    )


def _w_memory_arg(text: str) -> str | float:
    """``--w-memory``: ``auto`` or a share in (0, 1]."""
    if text.strip().lower() == "auto":
        return "auto"
    return positive_fraction(text)


def select_rows(result: PlanResult, best_per_schedule: bool, top: int | None) -> list[PlanRow]:
    rows = result.best_per_schedule() if best_per_schedule else list(result.rows)
    return rows if top is None else rows[:top]


def add_parser(subparsers: Any) -> None:
    """Adds ``plan`` to ``megatron-pp``'s sub-commands."""
    p = subparsers.add_parser(
        "plan",
        help="grid search over TP/PP/DP/micro-batch/schedule/recompute under a memory budget",
        description="Enumerate every valid (TP, PP, DP, micro-batch, virtual stages, schedule, recompute) "
        "configuration, drop those over the memory budget and rank the rest by estimated throughput.",
    )
    add_plan_arguments(p)
    o = p.add_argument_group("output")
    o.add_argument("--top", type=int, default=20, help="rows to print (default 20; 0 = all)")
    o.add_argument("--best-per-schedule", action="store_true", help="only each schedule's best configuration")
    o.add_argument("--json", action="store_true", help="print the plan as JSON")
    o.add_argument("--csv", action="store_true", help="print the ranked rows as CSV")
    o.add_argument("--save", metavar="PLAN.json", help="also write the plan (every fitting row) to this file")
    o.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None, help="progress bar on stderr")
    p.set_defaults(func=cmd_plan)


def _csv_cell(value: Any) -> Any:
    return "/".join(map(str, value)) if isinstance(value, list) else value


def print_models() -> None:
    import textwrap

    from .models import models_table

    rows = models_table()
    header = [k for k in rows[0] if k not in ("assumed", "source")]  # long texts: on their own lines
    table = format_table(header, [[str(r[k]) for k in header] for r in rows]).splitlines()
    print("\n".join(table[:2]))
    for line, row in zip(table[2:], rows, strict=True):
        print(line)
        for key in ("source", "assumed"):
            if row[key] != "-":
                print(textwrap.fill(f"{key}: {row[key]}", 100, initial_indent="    ", subsequent_indent="      "))


def cmd_plan(args: argparse.Namespace) -> int:
    if args.list_models:
        print_models()
        return 0
    planner = planner_from_args(args)
    result = planner.run(progress=args.progress)
    top = None if args.top == 0 else args.top
    rows = select_rows(result, args.best_per_schedule, top)
    if args.save:
        doc = plan_document(result, planner, result.rows)
        Path(args.save).write_text(json.dumps(doc, indent=1) + "\n")
    if args.json:
        doc = plan_document(result, planner, rows)
        doc["summary"] = summary_lines(result, planner)
        print(json.dumps(doc))
        return 0
    if args.csv:
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        keys = list(dict.fromkeys(k for row in rows for k in row.to_json_dict(per_rank=False))) or ["id"]
        writer.writerow(keys)
        for row in rows:
            d = row.to_json_dict(per_rank=False)
            writer.writerow([_csv_cell(d.get(k, "")) for k in keys])
        print(out.getvalue(), end="")
        return 0
    if tuple(args.schedules or ()) == ("auto",):
        from .auto import AutoDecision

        print(AutoDecision(result).table())
        print()
    if rows:
        print(format_table(TABLE_HEADER, table_rows(rows)))
    else:
        print("no configuration fits (see below)")
    print()
    print("\n".join(summary_lines(result, planner)))
    if args.save:
        print(f"wrote {args.save} ({len(result.rows)} configurations)")
    return 0
