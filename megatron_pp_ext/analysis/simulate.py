"""Event simulation of a lowered schedule with per-op costs.

Timing model (:mod:`megatron_pp_ext.schedules.timing`, one pass over the lowered programs, linear
in their length):

* every rank starts at time 0 and runs its program in order;
* a :class:`~megatron_pp_ext.schedules.lowering.Compute` starts when its rank is free and lasts ``t_f``,
  ``t_b``, ``t_w`` or ``t_bw`` of its stage;
* an :class:`~megatron_pp_ext.schedules.lowering.Exchange` posts its sends at once (non-blocking: a message
  sent at time ``t`` arrives at ``t + t_comm``); a local hand-off (same rank) costs nothing. What happens to its
  receives depends on ``comm``:

  - ``"async"`` (default; what the executor does): receives are posted and not waited for;
    each compute op waits only for the arrival of its own input, so communication overlaps
    compute and a receive the lowering posted early costs nothing;
  - ``"blocking"``: the exchange completes at the latest of the rank's time and the arrival
    of every receive it holds (no overlap: a rank stalls at an early-posted receive).

Data parallelism (``dp > 1`` or a ``collectives`` policy): the collectives that
:func:`~megatron_pp_ext.schedules.collectives.derive_collectives` places run on one
data-parallel stream per rank that overlaps compute, in issue order; a collective is issued when
its rank reaches its gap and lasts (ring algorithms over ``dp`` ranks, ``B`` bytes of the chunk's
parameters or gradients, ``bw`` bytes per time unit): all-reduce ``2(N-1)/N B/bw``,
reduce-scatter and all-gather ``(N-1)/N B/bw``, replica sync an all-reduce over 2. An op that
reads a chunk's weights waits for the chunk's pending unshard / parameter gather; the iteration
ends when the last op has ended and every stream has drained (``makespan`` then includes that
drain; the per-rank ``span`` stays the compute span). Without ``dp`` / ``collectives`` nothing of
this runs and results are exactly those of the plain model.

Activation memory, per rank: ``F`` adds its stage's activation, ``B`` frees the fraction
``1 - w_retained_fraction`` of it, ``W`` the rest, ``BW`` all of it. The peak is counted in
units of one stage-microbatch activation of this schedule's stages (``peak_activations``),
in 1F1B units (divided by how many stages of one replica a rank holds), and in bytes when
``activation_bytes`` is given.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import numpy as np

from ..schedules.collectives import (
    CollectiveKind,
    CollectivePlan,
    CollectivePolicy,
    check_collectives,
    derive_collectives,
    reduces_by_scatter,
)
from ..schedules.costs import Costs, PerStage, check_cost, expand_cost
from ..schedules.gc_pause import cyclic_gc_paused
from ..schedules.ir import Op, OpKind
from ..schedules.limits import check_simulated_ops
from ..schedules.lowering import CommPlan, LoweredSchedule
from ..schedules.op_arrays import KIND_B, KIND_BW, KIND_F, KIND_W, op_arrays
from ..schedules.schedule import Schedule
from ..schedules.timing import op_start_times, op_start_times_with_stream, repeat_iterations
from .moe_comm import MoeComm, op_times
from .schedule_check import DeadlockError, validate

__all__ = [
    "DEFAULT_COMM",
    "DEFAULT_OVERLAP",
    "DEFAULT_W_RETAINED_FRACTION",
    "DataParallelResult",
    "IterationResult",
    "MoeComm",
    "SimResult",
    "collective_time",
    "simulate",
]

#: Fraction of a stage's activation that stays alive after its ``B`` until its ``W``.
#: 1.0 counts an activation as live from ``F`` until its last backward op (``W`` or ``BW``)
#: ends: the convention under which the published peak-memory figures hold (ZB-H1 = 1F1B = p).
#: Realistically ``W`` keeps only the linear layers' inputs and output gradients; a user
#: modelling that sets e.g. 0.9 (so ``B`` frees 10% of the activation).
DEFAULT_W_RETAINED_FRACTION = 1.0
#: :func:`simulate`'s defaults that callers record with their results (the planner's memo): the
#: communication model (``async``: a message arrives ``t_comm`` after its producer ends, the sender does
#: not wait) and the overlap factor of a schedule's forward-and-backward pairs (dualpipev).
DEFAULT_COMM = "async"
DEFAULT_OVERLAP = 0.0


@dataclass
class SimResult:
    """What one simulation measured; plain data (``timeline`` is built on first access)."""

    schedule: str  # the schedule's name
    p: int
    m: int
    v: int  # chunks per rank
    makespan: float
    busy: list[float]  # per rank: sum of compute durations
    span: list[float]  # per rank: first op start to last op end
    idle: list[float]  # per rank: makespan - busy
    bubble_rate: float  # (C - Wmax) / C, C = max span, Wmax = max busy (zero-bubble paper)
    sync_bubble_rate: float  # (makespan - Wmax) / makespan
    bubble_rate_per_rank: list[float]  # (span_r - busy_r) / span_r
    sync_bubble_rate_per_rank: list[float]  # (makespan - busy_r) / makespan
    peak_activations: list[float]  # per rank, in stage-microbatch activations of this schedule
    peak_activations_1f1b_units: list[float]  # per rank, in one 1F1B stage's activations (M_a)
    peak_activation_bytes: list[float] | None
    p2p_messages: int  # cross-rank messages
    p2p_volume: float  # bytes when message_bytes was given, else = p2p_messages
    local_handoffs: int
    costs: Costs = field(repr=False, default_factory=Costs.unit)
    starts: list[list[float]] = field(repr=False, default_factory=list)  # per rank, start of each op in rank order
    ops: tuple[tuple[Op, ...], ...] = field(repr=False, default=())
    durations: _Durations | None = field(repr=False, compare=False, default=None)
    data_parallel: DataParallelResult | None = None  # with dp / collectives only
    iterations: IterationResult | None = None  # with iterations > 1 or post_validation only

    @cached_property
    def timeline(self) -> list[tuple[int, str, float, float]]:
        """``(rank, op, start, end)`` for every op, rank by rank in program order."""
        if self.durations is None:
            return []
        of = self.durations.of
        return [
            (rank, str(op), start, start + of(op))
            for rank, row in enumerate(self.ops)
            for op, start in zip(row, self.starts[rank], strict=True)
        ]

    def to_json_dict(self, include_timeline: bool = False, digits: int = 6) -> dict[str, object]:
        def r(x: float) -> float:
            return round(x, digits)

        out: dict[str, object] = {
            "schedule": self.schedule,
            "p": self.p,
            "m": self.m,
            "v": self.v,
            "makespan": r(self.makespan),
            "bubble_rate": r(self.bubble_rate),
            "sync_bubble_rate": r(self.sync_bubble_rate),
            "bubble_rate_per_rank": [r(x) for x in self.bubble_rate_per_rank],
            "sync_bubble_rate_per_rank": [r(x) for x in self.sync_bubble_rate_per_rank],
            "peak_activations": [r(x) for x in self.peak_activations],
            "peak_activations_1f1b_units": [r(x) for x in self.peak_activations_1f1b_units],
            "peak_activation_bytes": None
            if self.peak_activation_bytes is None
            else [r(x) for x in self.peak_activation_bytes],
            "p2p_messages": self.p2p_messages,
            "local_handoffs": self.local_handoffs,
        }
        if include_timeline:
            out["timeline"] = [[rank, op, r(s), r(e)] for rank, op, s, e in self.timeline]
        if self.data_parallel is not None:
            out["data_parallel"] = self.data_parallel.to_json_dict(digits)
        if self.iterations is not None:
            out["iterations"] = self.iterations.to_json_dict(digits)
        return out


@dataclass
class IterationResult:
    """Back-to-back iterations (:func:`~megatron_pp_ext.schedules.timing.repeat_iterations`)."""

    count: int  # iterations simulated
    post_validation: bool  # no global synchronisation before the optimizer step
    step: list[float]  # per rank: optimizer step time
    ends: list[list[float]]  # per iteration, per rank: end of its last op
    time: float  # per iteration, steady state: what a user gets

    def to_json_dict(self, digits: int = 6) -> dict[str, object]:
        return {
            "count": self.count,
            "post_validation": self.post_validation,
            "step": [round(x, digits) for x in self.step],
            "iteration_time": round(self.time, digits),
            "ends": [[round(x, digits) for x in row] for row in self.ends],
        }


@dataclass
class DataParallelResult:
    """The data-parallel stream of every rank (see the module doc); times in the costs' unit."""

    dp: int
    bandwidth: float  # bytes per time unit
    reduce: str  # "all-reduce" or "reduce-scatter"
    plan: CollectivePlan = field(repr=False)
    compute_end: list[float]  # per rank: end of its last op
    end: list[float]  # per rank: max(compute_end, stream drained)
    exposed: list[float]  # per rank: stall + tail, data-parallel time not hidden behind compute
    stall: list[float]  # per rank: time ops waited for a gather beyond their input and their rank
    tail: list[float]  # per rank: stream drain after the rank's last op
    stream_busy: list[float]  # per rank: sum of its collective durations
    collectives: list[tuple[int, str, int, float, float, float]]  # (rank, kind, stage, issued, start, end)

    @property
    def iteration_time(self) -> float:
        return max(self.end, default=0.0)

    def gathers(self, rank: int | None = None) -> int:
        """FSDP unshards (all-gathers) per iteration, on one rank or all."""
        return self.plan.count(CollectiveKind.UNSHARD, rank)

    def reduction_count(self, rank: int | None = None) -> int:
        """Gradient reductions (all-reduces or reduce-scatters) per iteration, on one rank or all: one per
        chunk, or one per chunk and unit when the policy reduces per unit (``grad_reduce_unit``)."""
        return self.plan.count(CollectiveKind.REDUCE_GRADS, rank)

    def reductions(self) -> list[tuple[int, int, float, float]]:
        """``(rank, stage, start, end)`` of every chunk's gradient reduction."""
        return [(r, s, b, e) for r, k, s, _, b, e in self.collectives if k == CollectiveKind.REDUCE_GRADS]

    def to_json_dict(self, digits: int = 6) -> dict[str, object]:
        def r(x: float) -> float:
            return round(x, digits)

        return {
            "dp": self.dp,
            "bandwidth": self.bandwidth,
            "reduce": self.reduce,
            "iteration_time": r(self.iteration_time),
            "compute_end": [r(x) for x in self.compute_end],
            "end": [r(x) for x in self.end],
            "exposed": [r(x) for x in self.exposed],
            "stall": [r(x) for x in self.stall],
            "tail": [r(x) for x in self.tail],
            "stream_busy": [r(x) for x in self.stream_busy],
            "gathers": [self.gathers(rank) for rank in range(len(self.end))],
            "reduction_counts": [self.reduction_count(rank) for rank in range(len(self.end))],
            "reductions": [
                {"rank": rank, "stage": stage, "start": r(b), "end": r(e)} for rank, stage, b, e in self.reductions()
            ],
            "collectives": [[rank, kind, stage, r(i), r(b), r(e)] for rank, kind, stage, i, b, e in self.collectives],
        }


def collective_time(kind: CollectiveKind, num_bytes: float, dp: int, bandwidth: float, scatter: bool) -> float:
    """Ring-algorithm time of one collective over ``dp`` ranks (replica sync: over 2)."""
    if kind == CollectiveKind.RESHARD:
        return 0.0
    if kind == CollectiveKind.REPLICA_SYNC:
        return num_bytes / bandwidth  # all-reduce over the 2 replicas: 2 (2-1)/2 B / bw
    share = (dp - 1) / dp * num_bytes / bandwidth
    if kind == CollectiveKind.REDUCE_GRADS and not scatter:
        return 2 * share
    return share


def simulate(
    schedule: Schedule,
    costs: Costs | None = None,
    *,
    activation_bytes: PerStage | None = None,
    w_retained_fraction: float = DEFAULT_W_RETAINED_FRACTION,
    message_bytes: PerStage | None = None,
    lowered: LoweredSchedule | None = None,
    comm: str = DEFAULT_COMM,
    collectives: CollectivePolicy | None = None,
    dp: int = 1,
    dp_bandwidth: float | None = None,
    param_bytes: PerStage | None = None,
    overlap: float = DEFAULT_OVERLAP,
    iterations: int = 1,
    post_validation: bool = False,
    step_time: float | list[float] = 0.0,
    moe: MoeComm | None = None,
) -> SimResult:
    """Simulate ``schedule`` (validated and lowered unless ``lowered`` is given).

    ``activation_bytes``: one stage-microbatch activation in bytes, one number or one per
    global stage. ``message_bytes``: size of the tensor crossing the boundary after stage
    ``s`` (the activation ``s -> s+1`` and the gradient ``s+1 -> s``), one number or one per
    stage; it changes ``p2p_volume`` and, with ``activation_bytes``, adds to
    ``peak_activation_bytes`` the receive buffers the executor posts ahead of their consumer
    (``CommPlan.receive_buffers``: what the tracer counts too). ``w_retained_fraction``: share of an activation a
    ``B`` keeps alive until its ``W`` (see :data:`DEFAULT_W_RETAINED_FRACTION`: 1.0 = the papers'
    counting; about 0.9 is realistic, as ``W`` needs only the linear layers' inputs and output
    gradients). Raises :class:`~megatron_pp_ext.analysis.schedule_check.ScheduleValidationError`
    subclasses for an invalid schedule, ``ValueError`` for bad costs or sizes.

    ``overlap`` (0..1): how much of the shorter op of each overlap pair (``Schedule.overlap_pairs``,
    DualPipe's forward-and-backward steps) hides under the longer one: a pair takes
    ``max + (1 - overlap) * min`` and sends both outputs at its end; busy time counts it so. 0 (default):
    the two ops run one after the other, as the executor runs them without an overlap hook.

    ``moe``: expert-parallel all-to-alls (:mod:`.moe_comm`): every ``F``, ``B`` and ``BW`` pays
    ``2 x layers x a2a`` after its compute, or, with ``moe.overlap``, each overlap pair of one forward
    and one backward runs as two streams (compute, communication) node by node, each side's
    all-to-alls under the other side's compute. Not with ``overlap`` (the plain pair factor); the
    pairs are the schedule's own (``Schedule.overlap_pairs``); ``busy`` counts a pair's step.

    Data parallelism (module doc): ``dp`` ranks per data-parallel group, ``collectives`` the policy
    (default: gradient reduction only), ``dp_bandwidth`` in bytes per time unit of ``costs`` and
    ``param_bytes`` the bytes of one stage's parameters (one number or one per global stage; its
    gradients are counted the same size). Needs ``comm="async"``.

    ``iterations`` (>= 1), ``post_validation``, ``step_time`` (optimizer step per rank, one number or
    one per rank): time that many back-to-back iterations (``result.iterations``, see
    :func:`~megatron_pp_ext.schedules.timing.repeat_iterations`): with a global synchronisation
    before every optimizer step, or without it (optimizer post-validation), a rank then starting
    its next iteration as soon as its own ops and its inputs allow. Without data parallelism only.
    Long because its docstring documents every option; the body checks them and hands on to :func:`_simulate`.
    """
    costs = Costs.unit() if costs is None else costs
    if comm not in COMM_MODELS:
        raise ValueError(f"comm must be one of {', '.join(COMM_MODELS)}, got {comm!r}")
    if not 0.0 <= w_retained_fraction <= 1.0:
        raise ValueError(f"w_retained_fraction must be in [0, 1], got {w_retained_fraction}")
    if isinstance(overlap, bool) or not isinstance(overlap, int | float) or not 0.0 <= overlap <= 1.0:
        raise ValueError(f"overlap must be a number in [0, 1], got {overlap!r}")
    if overlap and schedule.overlap_pairs and (comm != "async" or collectives is not None or dp != 1):
        raise ValueError("overlap pairs are timed with comm='async' and without data-parallel collectives only")
    if moe is not None and not isinstance(moe, MoeComm):
        raise ValueError(f"moe must be a MoeComm, got {moe!r}")
    if moe is not None and moe.overlap and overlap:
        raise ValueError("give either overlap (the plain pair factor) or moe with overlap (the two-stream pair model)")
    if moe is not None and moe.overlap and schedule.overlap_pairs and (collectives is not None or dp != 1):
        raise ValueError("overlapped MoE pairs are timed without data-parallel collectives only")
    if moe is not None and moe.overlap and comm != "async":
        raise ValueError("overlapped MoE pairs are timed with comm='async' only")
    repeat = _check_iterations(iterations, post_validation, step_time, schedule)
    if repeat is not None and (collectives is not None or dp != 1):
        raise ValueError("iterations / post_validation are simulated without data-parallel collectives only")
    if lowered is None:
        lowered = validate(schedule)
    elif lowered.schedule is not schedule and lowered.schedule != schedule:
        raise ValueError("lowered was made from a different schedule")
    dp_setup = None
    if collectives is not None or dp != 1:
        dp_setup = _dp_setup(schedule, collectives, dp, dp_bandwidth, param_bytes, comm)
    elif dp_bandwidth is not None or param_bytes is not None:
        raise ValueError("dp_bandwidth and param_bytes describe data parallelism: give dp (> 1) or collectives too")
    with cyclic_gc_paused():
        result = _simulate(
            schedule,
            costs,
            lowered,
            activation_bytes,
            w_retained_fraction,
            message_bytes,
            comm,
            dp_setup,
            overlap,
            moe,
        )
        if repeat is not None:
            result.iterations = _repeat(schedule, costs, lowered, comm, overlap, moe, *repeat)
        return result


def _check_iterations(
    iterations: int, post_validation: bool, step_time: float | list[float], schedule: Schedule
) -> tuple[int, bool, list[float]] | None:
    """The checked iteration settings, or None for one plain iteration (the default)."""
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations must be an integer >= 1, got {iterations!r}")
    check_simulated_ops(iterations, sum(len(row) for row in schedule.ops))
    checked = check_cost("step_time", step_time)
    p = schedule.num_ranks
    if isinstance(checked, tuple) and len(checked) != p:
        raise ValueError(f"step_time lists {len(checked)} per-rank times, the schedule has {p} ranks")
    steps = expand_cost("step_time", checked, p)
    if iterations == 1 and not post_validation and not any(steps):
        return None
    return iterations, bool(post_validation), steps


def _repeat(
    schedule: Schedule,
    costs: Costs,
    lowered: LoweredSchedule,
    comm: str,
    overlap: float,
    moe: MoeComm | None,
    iterations: int,
    post_validation: bool,
    steps: list[float],
) -> IterationResult:
    per_op, pair_steps = _with_moe(schedule, _op_durations(schedule, _Durations(costs, schedule.num_stages)), moe)
    t_comm = float(costs.t_comm)

    def run_once(start: list[float]) -> list[float]:
        blocking = comm == "blocking"
        return op_start_times(
            lowered,
            per_op,
            t_comm,
            blocking=blocking,
            overlap=overlap,
            pair_durations=pair_steps.durations if pair_steps else None,
            pair_sends=pair_steps.sends if pair_steps else None,
            start=start,
        )[1]

    out = repeat_iterations(run_once, schedule.num_ranks, iterations, post_validation=post_validation, step=steps)
    return IterationResult(iterations, post_validation, steps, out.ends, out.time)


class _DPSetup:
    __slots__ = ("bandwidth", "dp", "plan", "scatter", "sizes")

    def __init__(self, plan: CollectivePlan, dp: int, bandwidth: float, sizes: list[float]) -> None:
        self.plan, self.dp, self.bandwidth, self.sizes = plan, dp, bandwidth, sizes
        self.scatter = reduces_by_scatter(plan.policy)


def _dp_setup(
    schedule: Schedule,
    policy: CollectivePolicy | None,
    dp: int,
    bandwidth: float | None,
    param_bytes: PerStage | None,
    comm: str,
) -> _DPSetup:
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp (data-parallel size) must be an integer >= 1, got {dp!r}")
    if comm != "async":
        raise ValueError("the data-parallel stream is modelled with comm='async' only")
    if dp > 1 and (bandwidth is None or param_bytes is None):
        raise ValueError(f"dp={dp} needs dp_bandwidth (bytes per time unit) and param_bytes (per stage)")
    if bandwidth is not None and (isinstance(bandwidth, bool) or not math.isfinite(bandwidth) or bandwidth <= 0):
        raise ValueError(f"dp_bandwidth must be a finite number > 0 (bytes per time unit), got {bandwidth!r}")
    sizes = [0.0] * schedule.num_stages
    if param_bytes is not None:
        sizes = expand_cost("param_bytes", check_cost("param_bytes", param_bytes), schedule.num_stages)
    plan = derive_collectives(schedule, policy)
    check_collectives(plan)
    return _DPSetup(plan, dp, 1.0 if bandwidth is None else float(bandwidth), sizes)


def _simulate(
    schedule: Schedule,
    costs: Costs,
    lowered: LoweredSchedule,
    activation_bytes: PerStage | None,
    w_retained_fraction: float,
    message_bytes: PerStage | None,
    comm: str,
    dp_setup: _DPSetup | None = None,
    overlap: float = 0.0,
    moe: MoeComm | None = None,
) -> SimResult:
    """One timing of ``schedule`` under resolved costs, sizes and data-parallel set-up.

    Long because it threads durations, MoE pair steps, collectives and memory counting through one timing call in order.
    """
    num_stages = schedule.num_stages
    durations = _Durations(costs, num_stages, moe)
    per_op, pair_steps = _with_moe(schedule, _op_durations(schedule, _Durations(costs, num_stages)), moe)
    data_parallel = None
    try:
        if dp_setup is None:
            starts, last_end = op_start_times(
                lowered,
                per_op,
                float(costs.t_comm),
                blocking=comm == "blocking",
                overlap=overlap,
                pair_durations=pair_steps.durations if pair_steps else None,
                pair_sends=pair_steps.sends if pair_steps else None,
            )
        else:
            starts, last_end, data_parallel = _simulate_dp(schedule, lowered, per_op, float(costs.t_comm), dp_setup)
    except RuntimeError as exc:  # validate() rules this out
        raise DeadlockError(str(exc)) from None
    p = schedule.num_ranks
    span = [end - row[0] if row else 0.0 for row, end in zip(starts, last_end, strict=True)]
    makespan = max(last_end, default=0.0) if data_parallel is None else data_parallel.iteration_time
    peak, busy = _memory_and_busy(schedule, [1.0] * num_stages, w_retained_fraction, per_op)
    if overlap:  # a pair's shorter op hides overlap x its time under the longer one
        for rank, pair_starts in enumerate(schedule.overlap_pairs):
            busy[rank] -= overlap * sum(min(per_op[rank][i], per_op[rank][i + 1]) for i in pair_starts)
    if pair_steps is not None:  # a pair is busy for its step
        for rank, steps in enumerate(pair_steps.durations):
            busy[rank] -= sum(per_op[rank][i] + per_op[rank][i + 1] - step for i, step in steps.items())
    c_max = max(span, default=0.0)
    w_max = max(busy, default=0.0)
    per_rank_stages = schedule.placement.stages_per_rank_per_replica
    peak_bytes = None
    plan = lowered.plan
    if activation_bytes is not None:
        sizes = expand_cost("activation_bytes", activation_bytes, num_stages)
        buffers = None
        if message_bytes is not None and plan is not None:
            buffers = _receive_buffer_bytes(plan, expand_cost("message_bytes", message_bytes, num_stages))
        peak_bytes = _memory_and_busy(schedule, sizes, w_retained_fraction, None, buffers)[0]
    if plan is not None:
        messages, handoffs = plan.num_messages, len(plan.handoffs[0])
        boundaries: Iterable[int] = map(min, plan.src_stage, plan.dst_stage)  # the stage boundary each message crosses
    else:  # hand-made
        messages, handoffs = len(lowered.messages), len(lowered.local_handoffs)
        boundaries = (min(msg.src_stage, msg.dst_stage) for msg in lowered.messages)
    volume: float = float(messages)
    if message_bytes is not None:
        sizes = expand_cost("message_bytes", message_bytes, num_stages)
        volume = sum(map(sizes.__getitem__, boundaries))
    return SimResult(
        schedule=schedule.name,
        p=p,
        m=schedule.num_microbatches,
        v=schedule.chunks_per_rank,
        makespan=makespan,
        busy=busy,
        span=span,
        idle=[makespan - b for b in busy],
        bubble_rate=_ratio(c_max - w_max, c_max),
        sync_bubble_rate=_ratio(makespan - w_max, makespan),
        bubble_rate_per_rank=[_ratio(s - b, s) for s, b in zip(span, busy, strict=True)],
        sync_bubble_rate_per_rank=[_ratio(makespan - b, makespan) for b in busy],
        peak_activations=peak,
        peak_activations_1f1b_units=[x / per_rank_stages for x in peak],
        peak_activation_bytes=peak_bytes,
        p2p_messages=messages,
        p2p_volume=volume,
        local_handoffs=handoffs,
        costs=costs,
        starts=starts,
        ops=schedule.ops,
        durations=durations,
        data_parallel=data_parallel,
    )


_GATES = (CollectiveKind.UNSHARD, CollectiveKind.PARAM_SYNC)
_USES_WEIGHTS = (OpKind.F, OpKind.B, OpKind.BW)


def _simulate_dp(
    schedule: Schedule, lowered: LoweredSchedule, per_op: list[list[float]], t_comm: float, setup: _DPSetup
) -> tuple[list[list[float]], list[float], DataParallelResult]:
    """Timing with one data-parallel stream per rank (see the module doc)."""
    plan, dp, bw = setup.plan, setup.dp, setup.bandwidth
    streams: list[list[tuple[int, float]]] = []
    gates: list[list[int]] = []
    for rank, ops in enumerate(schedule.ops):
        items = plan.at[rank]
        streams.append(
            [(gap, collective_time(c.kind, setup.sizes[c.stage], dp, bw, setup.scatter)) for gap, c in items]
        )
        gate, latest, j = [], {}, 0  # latest: stage -> index of its last gather issued so far
        for i, op in enumerate(ops):
            while j < len(items) and items[j][0] <= i:
                if items[j][1].kind in _GATES:
                    latest[items[j][1].stage] = j
                j += 1
            gate.append(latest.get(op.stage, -1) if op.kind in _USES_WEIGHTS else -1)
        gates.append(gate)
    times = op_start_times_with_stream(lowered, per_op, t_comm, streams, gates)
    end = [max([t, *ends]) for t, ends in zip(times.last_end, times.end, strict=True)]
    tail = [max(0.0, e - t) for e, t in zip(end, times.last_end, strict=True)]
    result = DataParallelResult(
        dp=dp,
        bandwidth=bw,
        reduce="reduce-scatter" if setup.scatter else "all-reduce",
        plan=plan,
        compute_end=times.last_end,
        end=end,
        exposed=[st + tl for st, tl in zip(times.stall, tail, strict=True)],
        stall=times.stall,
        tail=tail,
        stream_busy=[sum(d for _, d in row) for row in streams],
        collectives=[
            (rank, str(c.kind), c.stage, times.issue[rank][k], times.begin[rank][k], times.end[rank][k])
            for rank, items in enumerate(plan.at)
            for k, (_, c) in enumerate(items)
        ],
    )
    return times.starts, times.last_end, result


def _ratio(num: float, den: float) -> float:
    """``num / den`` for an idle share; 0 when nothing ran, never negative from rounding."""
    return max(0.0, num / den) if den > 0 else 0.0


class _Durations:
    """Duration of an op by kind and global stage (with ``moe``: plus its all-to-alls, not overlapped)."""

    __slots__ = ("b", "bw", "f", "w")

    def __init__(self, costs: Costs, num_stages: int, moe: MoeComm | None = None) -> None:
        self.f, self.b, self.w, self.bw = costs.per_stage(num_stages)
        if moe is not None:
            extra = [2 * n * moe.a2a for n in moe.per_stage(num_stages)]
            self.f, self.b, self.bw = (
                [x + e for x, e in zip(t, extra, strict=True)] for t in (self.f, self.b, self.bw)
            )

    def of(self, op: Op) -> float:
        kind = op.kind
        table = self.f if kind is OpKind.F else self.bw if kind is OpKind.BW else self.b if kind is OpKind.B else self.w
        return table[op.stage]


COMM_MODELS = ("async", "blocking")


def _op_durations(schedule: Schedule, durations: _Durations) -> list[list[float]]:
    """Duration of every op, per rank in rank order."""
    arrays = op_arrays(schedule)
    num_stages = schedule.num_stages
    table = np.zeros(4 * num_stages)
    for code, values in ((KIND_F, durations.f), (KIND_B, durations.b), (KIND_W, durations.w), (KIND_BW, durations.bw)):
        table[code * num_stages : (code + 1) * num_stages] = values
    flat = table[arrays.kind.astype(np.int64) * num_stages + arrays.stage]
    return [flat[arrays.slice(rank)].tolist() for rank in range(schedule.num_ranks)]


class _PairSteps(NamedTuple):
    """Per rank, the step of each overlapped pair (by its first op) and when its two outputs leave."""

    durations: list[dict[int, float]]
    sends: list[dict[int, tuple[float, float]]]


def _with_moe(
    schedule: Schedule, per_op: list[list[float]], moe: MoeComm | None
) -> tuple[list[list[float]], _PairSteps | None]:
    """Op durations with the all-to-alls, and the overlapped pairs' steps (None: no pair is timed by the
    two-stream model)."""
    if moe is None:
        return per_op, None
    layers = moe.per_stage(schedule.num_stages)
    pairs = schedule.overlap_pairs or tuple(() for _ in schedule.ops)
    out, steps, sends = [], [], []
    for ops, compute, firsts in zip(schedule.ops, per_op, pairs, strict=True):
        serial, pair_steps, pair_sends = op_times(ops, compute, firsts, layers, moe)
        out.append(serial)
        steps.append(pair_steps)
        sends.append(pair_sends)
    return out, _PairSteps(steps, sends) if moe.overlap and schedule.overlap_pairs else None


def _receive_buffer_bytes(plan: CommPlan, message: list[float]) -> list[np.ndarray]:
    """Per rank, per op: bytes of the receive buffers posted and not yet taken when the op ends."""
    rows = plan.receive_buffers
    boundary = [min(a, b) for a, b in zip(plan.src_stage, plan.dst_stage, strict=True)]
    return [np.array([sum(message[boundary[mid]] for mid in mids) for mids in row], dtype=float) for row in rows]


def _memory_and_busy(
    schedule: Schedule,
    size: list[float],
    retained: float,
    op_durations: list[list[float]] | None,
    extra: list[np.ndarray] | None = None,
) -> tuple[list[float], list[float]]:
    """Peak live activation per rank (``size`` per stage; plus ``extra[r][k]`` alive at the end of
    op ``k``) and, given op durations, busy time per rank."""
    arrays = op_arrays(schedule)
    sizes = np.asarray(size, dtype=float)[arrays.stage]
    kind = arrays.kind
    # F adds its stage's activation, B frees (1 - retained) of it, W the rest, BW all of it.
    share = np.select([kind == KIND_F, kind == KIND_B, kind == KIND_W], [1.0, -(1.0 - retained), -retained], -1.0)
    delta = share * sizes
    peaks, busy = [], []
    for rank in range(schedule.num_ranks):
        part = delta[arrays.slice(rank)]
        live = np.cumsum(part)  # running sum in op order, as a rank runs them
        if extra is not None and len(live):
            live = live + extra[rank]
        peaks.append(max(0.0, float(live.max())) if len(live) else 0.0)
        if op_durations is not None:
            busy.append(float(np.cumsum(op_durations[rank])[-1]) if op_durations[rank] else 0.0)
    return peaks, busy
