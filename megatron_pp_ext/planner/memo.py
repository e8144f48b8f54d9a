"""What the planner computes from schedules and costs alone, and keeps: built and validated schedules,
their activation and reduction profiles, simulations (:class:`PlannerMemo`), and how a simulation is keyed
(costs normalised by the largest forward time, 3 significant digits: a simulation depends on costs only
through their ratios) and run (the simulator, or a compiled :class:`.retiming.TimingProgram` once a schedule
is timed often)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..analysis.simulate import DEFAULT_COMM, DEFAULT_OVERLAP, simulate
from ..schedules.costs import Costs
from ..schedules.lowering import LoweredSchedule
from ..schedules.schedule import Schedule
from .dp_stream import ReductionProfile
from .memory import ActivationProfile
from .retiming import TimingProgram

# a schedule simulated this often gets a compiled TimingProgram (faster re-timing). Compiling costs about 8
# simulations and a compiled timing a sixth of one (a 64-GPU search: 1140 compiles 5.6 s, 1383 simulations 0.8 s,
# 3920 compiled timings 0.4 s of CPU), so it pays only for a schedule timed about 10 times or more; most builds
# of a search are timed a few times (the shapes that share them x recompute settings) and are never compiled
COMPILE_AFTER = 10


SIM_COMM = DEFAULT_COMM  # the simulator's communication model, recorded with each memoized result
SIM_KWARGS: dict[str, Any] = {"comm": SIM_COMM}
#: Back-to-back iterations timed per configuration with ``--post-validation`` (steady state).
POST_VALIDATION_ITERATIONS = 3
# overlap factor of a schedule's forward-and-backward pairs (dualpipev) when none is given: the simulator's
SIM_OVERLAP = DEFAULT_OVERLAP


def round_sig(x: float, digits: int = 3) -> float:
    if x == 0 or not math.isfinite(x):
        return x
    return round(x, digits - 1 - math.floor(math.log10(abs(x))))


def normalise(costs: Costs, num_stages: int) -> tuple[float, tuple[Any, ...]]:
    """``(scale, key)``: costs divided by the largest forward time, rounded to 3 digits."""
    f, b, w, _ = costs.per_stage(num_stages)
    scale = max(f) or 1.0
    key = (
        tuple(round_sig(x / scale) for x in f),
        tuple(round_sig(x / scale) for x in b),
        tuple(round_sig(x / scale) for x in w),
        round_sig(float(costs.t_comm) / scale),
    )
    return scale, key


@dataclass
class Sim:
    makespan: float  # in units of the normalisation scale
    busy_max: float
    span_max: float


@dataclass
class Built:
    """A generated and validated schedule (or why it could not be)."""

    schedule: Schedule | None
    lowered: LoweredSchedule | None
    error: str | None
    timing: TimingProgram | None = None
    uses: int = 0
    starts: list[list[float]] | None = None  # op start times of the simulation before it is compiled


@dataclass
class PlannerMemo:
    """What a :class:`~.search.Planner` computes that depends on the schedules and costs only, not on the model,
    device or budget: built and validated schedules, their activation profiles, simulations and
    reduction profiles. Planners given the same memo share it, so a schedule is built, validated and
    compiled once (``plan_spec`` over several global batches, ``grid --spec`` over several specs).
    Keys hold everything the value depends on; registering a schedule under a taken name does not
    happen (the registry refuses it), so the name identifies the generator."""

    built: dict[tuple[Any, ...], Built] = field(default_factory=dict)
    profiles: dict[tuple[Any, ...], ActivationProfile] = field(default_factory=dict)
    sims: dict[tuple[Any, ...], Sim] = field(default_factory=dict)
    reductions: dict[tuple[Any, ...], ReductionProfile] = field(default_factory=dict)


def build_key(
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


def simulate_once(built: Built, f: Any, b: Any, w: Any, c: float, overlap: float = 0.0) -> Sim:
    """One iteration with a synchronous step; compiled once a schedule is timed often (the compiled
    program runs overlap pairs serially, so with an overlap factor the simulator times it)."""
    assert built.schedule is not None and built.lowered is not None
    if built.timing is None and built.uses >= COMPILE_AFTER and not overlap:
        built.timing = TimingProgram(built.lowered, SIM_COMM, built.starts)
        built.starts = None
    if built.timing is not None and not overlap:
        bw = tuple(x + y for x, y in zip(b, w, strict=True))
        timing = built.timing.run_tables((f, b, w, bw), c)
        return Sim(timing.makespan, max(timing.busy), max(timing.span))
    kwargs = {**SIM_KWARGS, "overlap": overlap} if overlap else SIM_KWARGS
    result = simulate(built.schedule, Costs(f, b, w, None, c), lowered=built.lowered, **kwargs)
    if not overlap and min(min(f), min(b), min(w)) > 0 and built.uses + 1 >= COMPILE_AFTER:
        built.starts = result.starts  # its start times order the ops topologically: kept for the compile only
    return Sim(result.makespan, max(result.busy), max(result.span))
