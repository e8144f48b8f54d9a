"""Adaptive unit size for ``zeropp`` (``unit_size="auto"``, ``--pipeline-unit-size auto``).

For every candidate ``U`` (the divisors of ``m``: no remainder unit) the schedule is generated with the
given op costs, validated and simulated, with the data-parallel stream when ``dp > 1`` (FSDP gathers and
reduce-scatters timed from ``param_bytes`` and ``dp_bandwidth``). Each candidate's memory is its peak
live activations (simulator, worst rank) in ``M_a`` (one 1F1B stage's activation for one micro-batch,
= ``v`` looped-stage activations) and, when byte sizes are given, bytes: activations plus the FSDP
gathered chunks (``fsdp_max_unsharded`` full chunks of ``param_bytes``). Candidates over the budget
(``memory_limit`` in ``M_a``, ``memory_budget`` in bytes) run under the generator's activation cap (a
forward waits for memory) and are dropped if they still exceed it (a unit of ``U`` needs ``U`` M_a, so
larger units are skipped); the fastest remaining one wins,
ties to the smaller memory. :meth:`UnitChoice.table` prints the choice and the alternatives.

``registry.generate("zeropp", p, m, unit_size="auto", ...)`` reaches :func:`choose_unit_size` through the
chooser this module registers (:func:`megatron_pp_ext.schedules.registry.register_chooser`): the generator
takes a number, as the schedules package never simulates. :func:`unit_size_context` gives the choice what
a registry request does not carry (the data-parallel stream, a report of the table).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from ..schedules import registry
from ..schedules.collectives import CollectiveKind, declared_fsdp_limit, policy_for
from ..schedules.generators.common import ScheduleParameterError, check_int
from ..schedules.generators.zeropp import FSDP_MAX_UNSHARDED, zeropp
from ..schedules.schedule import Schedule
from .schedule_check import validate
from .simulate import simulate

__all__ = [
    "Measurement",
    "UnitCandidate",
    "UnitChoice",
    "UnitSizeContext",
    "choose_unit_size",
    "evaluate_unit_size",
    "measure_schedule",
    "unit_size_context",
]


@dataclass(frozen=True)
class UnitCandidate:
    unit_size: int
    iteration_time: float  # makespan, or the data-parallel iteration time with dp > 1
    bubble: float  # sync bubble rate of the compute alone
    peak_activations: float  # worst rank, in M_a (1F1B stage activations)
    gathers: int  # FSDP all-gathers per iteration, worst rank (0 without FSDP)
    reductions: int  # gradient reductions per iteration, worst rank (FSDP: per chunk and unit; 0 without dp)
    exposed: float  # worst rank's data-parallel time not hidden behind compute
    memory_bytes: float | None  # activations + gathered FSDP chunks, worst rank (None without sizes)
    fits: bool


@dataclass(frozen=True)
class UnitChoice:
    schedule: Schedule
    best: UnitCandidate
    candidates: tuple[UnitCandidate, ...]
    skipped: tuple[int, ...] = ()  # unit sizes larger than the activation cap allows
    cap: float | None = None  # live activations per rank allowed, M_a

    def table(self) -> str:
        lines = ["zeropp --pipeline-unit-size auto: candidates (time in --costs units)"]
        lines.append(
            f"{'U':>4} {'iteration':>11} {'bubble':>7} {'act (M_a)':>9} {'gathers':>7} {'reduces':>7} "
            f"{'exposed':>9} {'memory':>10}  "
        )
        for c in self.candidates:
            mem = "-" if c.memory_bytes is None else f"{c.memory_bytes / 1e9:.3g} GB"
            mark = "<- chosen" if c is self.best else ("" if c.fits else "over budget")
            lines.append(
                f"{c.unit_size:>4} {c.iteration_time:>11.4g} {c.bubble:>7.4f} {c.peak_activations:>9.3g} "
                f"{c.gathers:>7} {c.reductions:>7} {c.exposed:>9.4g} {mem:>10}  {mark}"
            )
        if self.skipped:
            lines.append(
                f"skipped U = {', '.join(map(str, self.skipped))}: a unit of U needs U M_a, the budget leaves "
                f"{self.cap:.3g} M_a"
            )
        if self.cap is not None:
            lines.append(f"activations capped at {self.cap:.3g} M_a per rank (forwards wait for memory)")
        return "\n".join(lines)


@dataclass(frozen=True)
class Measurement:
    """One schedule simulated as :func:`evaluate_unit_size` measures it (any schedule, not only zeropp)."""

    iteration_time: float  # makespan, or the data-parallel iteration time with dp > 1
    bubble: float  # sync bubble rate of the compute alone
    peak_activations: float  # worst rank, in stage activations (the simulator's count)
    gathers: int
    reductions: int
    exposed: float
    memory_bytes: float | None


def measure_schedule(
    schedule: Schedule,
    costs: object = None,
    *,
    dp: int = 1,
    dp_bandwidth: float | None = None,
    param_bytes: float | None = None,
    fsdp: bool = False,
    activation_bytes: float | None = None,
) -> Measurement:
    """Simulate ``schedule`` alone and, with ``dp > 1``, with its data-parallel stream (FSDP collectives
    from its declared policy when ``fsdp``); memory = peak activations x ``activation_bytes`` (one stage's,
    one micro-batch) + the FSDP chunks it gathers at once (``param_bytes`` each). See the module doc."""
    lowered = validate(schedule)
    plain = simulate(schedule, costs, lowered=lowered)  # type: ignore[arg-type]
    time, gathers, reductions, exposed = plain.makespan, 0, 0, 0.0
    p = schedule.num_ranks
    if dp > 1:
        result = simulate(
            schedule,
            costs,  # type: ignore[arg-type]
            lowered=lowered,
            collectives=policy_for(schedule, fsdp=fsdp),
            dp=dp,
            dp_bandwidth=dp_bandwidth,
            param_bytes=param_bytes,
        )
        data = result.data_parallel
        assert data is not None
        time, exposed = data.iteration_time, max(data.exposed)
        gathers = max(data.plan.count(CollectiveKind.UNSHARD, r) for r in range(p)) if fsdp else 0
        reductions = max(data.reduction_count(r) for r in range(p))
    memory = None
    if activation_bytes is not None:
        memory = max(plain.peak_activations) * activation_bytes
        if fsdp and param_bytes is not None:
            memory += min(declared_fsdp_limit(schedule) or 1, schedule.chunks_per_rank) * param_bytes
    return Measurement(time, plain.sync_bubble_rate, max(plain.peak_activations), gathers, reductions, exposed, memory)


def evaluate_unit_size(
    p: int,
    m: int,
    unit_size: int,
    *,
    v: int | None = None,
    costs: object = None,
    dp: int = 1,
    dp_bandwidth: float | None = None,
    param_bytes: float | None = None,
    fsdp: bool = False,
    activation_bytes: float | None = None,
    memory_limit: float | None = None,
) -> tuple[Schedule, UnitCandidate]:
    """Generate ``zeropp`` with ``unit_size`` and measure it (see the module doc). ``param_bytes``: one
    chunk's parameters; ``activation_bytes``: one looped stage's activation for one micro-batch."""
    schedule = zeropp(p, m, v=v, unit_size=unit_size, costs=costs, memory_limit=memory_limit)
    got = measure_schedule(
        schedule,
        costs,
        dp=dp,
        dp_bandwidth=dp_bandwidth,
        param_bytes=param_bytes,
        fsdp=fsdp,
        activation_bytes=activation_bytes,
    )
    candidate = UnitCandidate(
        unit_size,
        got.iteration_time,
        got.bubble,
        got.peak_activations / schedule.chunks_per_rank,
        got.gathers,
        got.reductions,
        got.exposed,
        got.memory_bytes,
        True,
    )
    return schedule, candidate


def choose_unit_size(
    p: int,
    m: int,
    *,
    v: int | None = None,
    costs: object = None,
    memory_limit: float | None = None,
    memory_budget: float | None = None,
    dp: int = 1,
    dp_bandwidth: float | None = None,
    param_bytes: float | None = None,
    fsdp: bool = False,
    activation_bytes: float | None = None,
    unit_sizes: Sequence[int] | None = None,
) -> UnitChoice:
    """Pick ``zeropp``'s unit size (module doc). ``memory_limit``: activations in ``M_a``;
    ``memory_budget``: bytes (needs ``activation_bytes``). Raises ScheduleParameterError naming
    ``--pipeline-memory-limit`` when no unit size fits."""
    if memory_budget is not None and activation_bytes is None:
        raise ScheduleParameterError("zeropp auto: a memory budget in bytes needs activation_bytes")
    sizes = list(unit_sizes) if unit_sizes is not None else [u for u in range(1, m + 1) if m % u == 0]
    chunks = 2 if v is None else v
    cap = memory_limit  # the generator's activation cap, in M_a: the limit, or what the byte budget leaves
    if memory_budget is not None and activation_bytes is not None:
        gathered = min(FSDP_MAX_UNSHARDED, chunks) * param_bytes if fsdp and param_bytes is not None else 0.0
        from_budget = (memory_budget - gathered) / (activation_bytes * chunks)
        cap = from_budget if cap is None else min(cap, from_budget)
    built: list[tuple[Schedule, UnitCandidate]] = []
    skipped = [u for u in sizes if cap is not None and u > cap]  # a unit of U needs U M_a (blockwise)
    for unit in sizes:
        if unit in skipped:
            continue
        schedule, c = evaluate_unit_size(
            p,
            m,
            unit,
            v=v,
            costs=costs,
            dp=dp,
            dp_bandwidth=dp_bandwidth,
            param_bytes=param_bytes,
            fsdp=fsdp,
            activation_bytes=activation_bytes,
            memory_limit=cap,
        )
        fits = (memory_limit is None or c.peak_activations <= memory_limit + 1e-9) and (
            memory_budget is None or (c.memory_bytes is not None and c.memory_bytes <= memory_budget)
        )
        built.append((schedule, UnitCandidate(**{**c.__dict__, "fits": fits})))
    fitting = [(s, c) for s, c in built if c.fits]
    if not fitting:
        given = [f"memory_limit {memory_limit:g} M_a (--memory-limit; --pipeline-memory-limit under megatron)"]
        given = given if memory_limit is not None else []
        if memory_budget is not None:
            given.append(f"a budget of {memory_budget / 1e9:.3g} GB")
        raise ScheduleParameterError(
            f"zeropp: no unit size in {sizes} fits the memory budget ({', '.join(given)}): it leaves "
            f"{cap if cap is None else round(cap, 3)} M_a of activations per rank, a unit of U micro-batches needs "
            "at least U"
        )
    schedule, best = min(fitting, key=lambda sc: (round(sc[1].iteration_time, 9), sc[1].peak_activations))
    schedule.params["unit_size_auto"] = True
    return UnitChoice(schedule, best, tuple(c for _, c in built), tuple(skipped), cap)


@dataclass(frozen=True)
class UnitSizeContext:
    """What the registry's request cannot carry: the data-parallel stream to time the candidates with
    (``dp`` > 1: ``dp_bandwidth``, ``param_bytes``, ``fsdp``) and who is told the choice (``report``)."""

    dp: int = 1
    dp_bandwidth: float | None = None
    param_bytes: float | None = None
    fsdp: bool = False
    report: Callable[[UnitChoice], None] | None = None


_CONTEXT: ContextVar[UnitSizeContext | None] = ContextVar("zeropp_unit_size_context", default=None)


@contextmanager
def unit_size_context(context: UnitSizeContext) -> Iterator[None]:
    """Within the block, ``unit_size="auto"`` requests are timed and reported as ``context`` says."""
    token = _CONTEXT.set(context)
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def _choose(info: registry.ScheduleInfo, p: int, m: int, checked: dict[str, object]) -> Schedule:
    """The registry's chooser for zeropp's ``unit_size="auto"`` (the request already checked there)."""
    generator_keywords = ("v", "unit_size", "costs", "memory_limit")
    if any(value is not None for key, value in checked.items() if key not in generator_keywords):
        return info.generate(p, m, **checked)  # the generator refuses an unknown keyword first
    check_int("m", m, 1)
    context = _CONTEXT.get() or UnitSizeContext()
    choice = choose_unit_size(
        p,
        m,
        v=checked.get("v"),  # type: ignore[arg-type]
        costs=checked.get("costs"),
        memory_limit=checked.get("memory_limit"),  # type: ignore[arg-type]
        dp=context.dp,
        dp_bandwidth=context.dp_bandwidth,
        param_bytes=context.param_bytes,
        fsdp=context.fsdp,
    )
    if context.report is not None:
        context.report(choice)
    return choice.schedule


registry.register_chooser("zeropp", "unit_size", _choose)
