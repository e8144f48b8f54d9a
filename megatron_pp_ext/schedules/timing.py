"""Start time of every op of a lowered schedule, given each op's duration.

The one timing core: :func:`megatron_pp_ext.analysis.simulate.simulate` reports from it and
``v-zb`` chooses among its candidate orders with it. Every rank starts at 0 and runs its ops in
order; a message is sent right after its producer (as the lowering places it) and arrives
``t_comm`` later. ``blocking=False`` (what the executor does): an op waits only for the arrival
of its own input; ``blocking=True``: a rank waits at each batch of receives the lowering placed
(possibly early, see :mod:`.lowering`) until all of them have arrived.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from .lowering import LoweredSchedule

__all__ = ["Iterations", "StreamTimes", "op_start_times", "op_start_times_with_stream", "repeat_iterations"]

_NOT_SENT, _AWAITED = -1.0, -2.0


def op_start_times(
    lowered: LoweredSchedule,
    durations: Sequence[list[float]],
    t_comm: float,
    *,
    blocking: bool = False,
    overlap: float = 0.0,
    start: Sequence[float] | None = None,
) -> tuple[list[list[float]], list[float]]:
    """``(starts, last_end)``: per rank the start of each op in rank order, and the end of its
    last op (its start clock for an empty rank). ``durations[r][i]`` is the duration of op ``i`` of
    rank ``r``; ``start[r]`` when rank ``r`` is free to begin (default 0: one iteration alone).

    ``overlap`` (0..1, non-blocking receives only): the schedule's overlap pairs run as one step
    that starts once both inputs are there, takes ``max + (1 - overlap) * min`` of the two
    durations and sends both outputs at its end. With 0 (default) a pair runs as two plain ops.

    Raises ``RuntimeError`` if some rank waits for a message that never comes (a lowering that
    :func:`~megatron_pp_ext.analysis.validate.validate` would reject).
    """
    plan = lowered.timing_plan
    p = len(durations)
    arrival = [_NOT_SENT] * plan.num_messages
    starts: list[list[float]] = [[] for _ in range(p)]
    clock = [0.0] * p if start is None else [float(x) for x in start]
    begin = clock[:]
    pc = [0] * p
    pairs = lowered.schedule.overlap_pairs if overlap else ()
    if pairs and blocking:
        raise ValueError("overlap pairs are timed with non-blocking receives only")
    if pairs:
        first = [bytearray(len(row)) for row in durations]
        for rank, row in enumerate(pairs):
            for i in row:
                first[rank][i] = 1
        inputs, sends, dst = plan.inputs_of_ops, plan.sends_after_ops, plan.dst_rank
        _run_paired(durations, first, overlap, inputs, sends, dst, t_comm, arrival, starts, clock, pc)
    else:
        run, waits = (_run_blocking, plan.receive_groups) if blocking else (_run_async, plan.inputs_of_ops)
        run(durations, waits, plan.sends_after_ops, plan.dst_rank, t_comm, arrival, starts, clock, pc)  # type: ignore[operator]
    stuck = [r for r in range(p) if pc[r] < len(durations[r])]
    if stuck:
        raise RuntimeError(f"simulation stuck: ranks {stuck} wait for messages that are never sent")
    if pairs:  # a rank's clock is the end of its last step
        last_end = [clock[r] if starts[r] else begin[r] for r in range(p)]
    else:
        last_end = [row[-1] + dur[-1] if row else b for row, dur, b in zip(starts, durations, begin, strict=True)]
    return starts, last_end


class Iterations(NamedTuple):
    """What :func:`repeat_iterations` found."""

    ends: list[list[float]]  # per iteration, per rank: end of the rank's last op
    ready: list[float]  # per iteration: when every rank has stepped and may begin the next one
    time: float  # time per iteration in steady state (what a user gets)


def repeat_iterations(
    run_once: Callable[[list[float]], Sequence[float]],
    num_ranks: int,
    iterations: int,
    *,
    post_validation: bool = False,
    step: Sequence[float] | None = None,
) -> Iterations:
    """Time ``iterations`` back-to-back iterations of one schedule.

    ``run_once(start)`` times one iteration whose ranks are free to begin at ``start[r]`` and
    returns the end of each rank's last op (one iteration's messages are all consumed within it,
    so iterations only meet through their ranks' clocks). ``step[r]``: rank ``r``'s optimizer step
    time (default 0). Without post-validation every iteration ends with a global synchronisation
    before the step (the gradient-norm / found-inf reductions of a synchronous optimizer), so rank
    ``r`` begins the next one at ``max(ends) + step[r]``; with it (the zero-bubble paper's optimizer
    post-validation) at its own ``ends[r] + step[r]``, its dependencies permitting.

    ``time``: ``(ready[N-1] - ready[0]) / (N - 1)`` for ``N >= 2`` iterations (steady state: the
    first iteration's ramp-up is not counted), ``ready[0]`` for one, where ``ready[k]`` is the time
    every rank has finished iteration ``k`` and its step.
    """
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations must be an integer >= 1, got {iterations!r}")
    steps = [0.0] * num_ranks if step is None else [float(x) for x in step]
    if len(steps) != num_ranks:
        raise ValueError(f"step lists {len(steps)} per-rank times, the schedule has {num_ranks} ranks")
    begin = [0.0] * num_ranks
    ends: list[list[float]] = []
    ready: list[float] = []
    for _ in range(iterations):
        end = [float(x) for x in run_once(begin)]
        ends.append(end)
        if post_validation:
            begin = [e + s for e, s in zip(end, steps, strict=True)]
        else:
            barrier = max(end, default=0.0)
            begin = [barrier + s for s in steps]
        ready.append(max(begin, default=0.0))
    time = ready[0] if iterations == 1 else (ready[-1] - ready[0]) / (iterations - 1)
    return Iterations(ends, ready, time)


def _run_async(
    durations: Sequence[list[float]],
    inputs: list[list[int]],
    sent_after: list[list[int]],
    dst: list[int],
    t_comm: float,
    arrival: list[float],
    starts: list[list[float]],
    clock: list[float],
    pc: list[int],
) -> None:
    """Each op waits for its own input (``inputs[r][k]``: message id, -1 for none)."""
    stack = list(range(len(durations) - 1, -1, -1))
    while stack:
        rank = stack.pop()
        dur, wait, sends = durations[rank], inputs[rank], sent_after[rank]
        n = len(dur)
        k, t = pc[rank], clock[rank]
        add_start = starts[rank].append
        while k < n:
            need = wait[k]
            if need >= 0:
                at = arrival[need]
                if at < 0:  # not sent yet: its sender resumes this rank
                    arrival[need] = _AWAITED
                    break
                if at > t:
                    t = at
            add_start(t)
            t += dur[k]
            mid = sends[k]
            if mid >= 0:
                if arrival[mid] == _AWAITED:
                    stack.append(dst[mid])
                if arrival[mid] < 0:
                    arrival[mid] = t + t_comm
            k += 1
        pc[rank], clock[rank] = k, t


def _run_paired(
    durations: Sequence[list[float]],
    first: list[bytearray],
    overlap: float,
    inputs: list[list[int]],
    sent_after: list[list[int]],
    dst: list[int],
    t_comm: float,
    arrival: list[float],
    starts: list[list[float]],
    clock: list[float],
    pc: list[int],
) -> None:
    """:func:`_run_async` where ``first[r][k]`` marks an overlap pair (ops ``k``, ``k+1``) run as one step."""
    stack = list(range(len(durations) - 1, -1, -1))
    while stack:
        rank = stack.pop()
        dur, wait, sends, pair = durations[rank], inputs[rank], sent_after[rank], first[rank]
        n = len(dur)
        k, t = pc[rank], clock[rank]
        while k < n:
            width = 2 if pair[k] else 1
            ready, blocked = t, False
            for need in wait[k : k + width]:
                if need >= 0:
                    at = arrival[need]
                    if at < 0:  # not sent yet: its sender resumes this rank
                        arrival[need] = _AWAITED
                        blocked = True
                    elif at > ready:
                        ready = at
            if blocked:
                break
            t = ready
            if width == 2:
                a, b = dur[k], dur[k + 1]
                starts[rank] += [t, t]
                t += max(a, b) + (1.0 - overlap) * min(a, b)
            else:
                starts[rank].append(t)
                t += dur[k]
            for mid in sends[k : k + width]:
                if mid >= 0:
                    if arrival[mid] == _AWAITED:
                        stack.append(dst[mid])
                    if arrival[mid] < 0:
                        arrival[mid] = t + t_comm
            k += width
        pc[rank], clock[rank] = k, t


def _run_blocking(
    durations: Sequence[list[float]],
    groups: list[list[tuple[int, ...] | None]],
    sent_after: list[list[int]],
    dst: list[int],
    t_comm: float,
    arrival: list[float],
    starts: list[list[float]],
    clock: list[float],
    pc: list[int],
) -> None:
    """Each op waits for every receive of the batch before it (``groups[r][k]``, None for none)."""
    outstanding = [0] * len(durations)  # messages a blocked rank still waits for
    stack = list(range(len(durations) - 1, -1, -1))
    while stack:
        rank = stack.pop()
        dur, wait, sends = durations[rank], groups[rank], sent_after[rank]
        n = len(dur)
        k, t = pc[rank], clock[rank]  # resumed at op k: its batch is checked again, all arrived now
        add_start = starts[rank].append
        while k < n:
            group = wait[k]
            if group is not None:
                missing = 0
                for mid in group:
                    at = arrival[mid]
                    if at < 0:
                        arrival[mid] = _AWAITED
                        missing += 1
                    elif at > t:
                        t = at
                if missing:
                    outstanding[rank] = missing
                    break
            add_start(t)
            t += dur[k]
            mid = sends[k]
            if mid >= 0 and arrival[mid] < 0:
                if arrival[mid] == _AWAITED:
                    peer = dst[mid]
                    outstanding[peer] -= 1
                    if not outstanding[peer]:
                        stack.append(peer)
                arrival[mid] = t + t_comm
            k += 1
        pc[rank], clock[rank] = k, t


class StreamTimes(NamedTuple):
    """What :func:`op_start_times_with_stream` found, per rank."""

    starts: list[list[float]]  # start of each op in rank order
    last_end: list[float]  # end of the last op (0 for an empty rank)
    issue: list[list[float]]  # per collective (in issue order): when the rank reached its gap
    begin: list[list[float]]  # when it started on the stream
    end: list[list[float]]  # when it finished
    stall: list[float]  # time ops waited for a collective beyond their input and their rank


def op_start_times_with_stream(
    lowered: LoweredSchedule,
    durations: Sequence[list[float]],
    t_comm: float,
    collectives: Sequence[Sequence[tuple[int, float]]],
    gate: Sequence[Sequence[int]],
) -> StreamTimes:
    """:func:`op_start_times` (non-blocking receives) plus one collective stream per rank.

    ``collectives[r]``: ``(gap, duration)`` in issue order (gap ``i`` = just before op ``i``).
    A collective is issued when its rank reaches its gap (the end of the op before it) and runs
    on the rank's stream after the collectives issued before it, overlapping compute.
    ``gate[r][i]``: index in ``collectives[r]`` of the collective op ``i`` waits for (an FSDP
    unshard or parameter gather of its chunk), -1 for none.
    """
    plan = lowered.timing_plan
    p = len(durations)
    inputs, sent_after, dst = plan.inputs_of_ops, plan.sends_after_ops, plan.dst_rank
    arrival = [_NOT_SENT] * plan.num_messages
    starts: list[list[float]] = [[] for _ in range(p)]
    issue: list[list[float]] = [[] for _ in range(p)]
    begin: list[list[float]] = [[] for _ in range(p)]
    end: list[list[float]] = [[] for _ in range(p)]
    stall = [0.0] * p
    free = [0.0] * p  # when each rank's stream is free
    clock = [0.0] * p
    pc = [0] * p
    stack = list(range(p - 1, -1, -1))
    while stack:
        rank = stack.pop()
        dur, wait, sends, colls, gates = durations[rank], inputs[rank], sent_after[rank], collectives[rank], gate[rank]
        n = len(dur)
        k, t = pc[rank], clock[rank]
        while k <= n:
            c = len(issue[rank])
            while c < len(colls) and colls[c][0] <= k:  # issue what the rank reached (once)
                start = max(t, free[rank])
                free[rank] = start + colls[c][1]
                issue[rank].append(t)
                begin[rank].append(start)
                end[rank].append(free[rank])
                c += 1
            if k == n:
                break
            ready = t
            need = wait[k]
            if need >= 0:
                at = arrival[need]
                if at < 0:  # not sent yet: its sender resumes this rank
                    arrival[need] = _AWAITED
                    break
                ready = max(ready, at)
            g = gates[k]
            if g >= 0 and end[rank][g] > ready:
                stall[rank] += end[rank][g] - ready
                ready = end[rank][g]
            starts[rank].append(ready)
            t = ready + dur[k]
            mid = sends[k]
            if mid >= 0:
                if arrival[mid] == _AWAITED:
                    stack.append(dst[mid])
                if arrival[mid] < 0:
                    arrival[mid] = t + t_comm
            k += 1
        pc[rank], clock[rank] = k, t
    stuck = [r for r in range(p) if pc[r] < len(durations[r])]
    if stuck:
        raise RuntimeError(f"simulation stuck: ranks {stuck} wait for messages that are never sent")
    last_end = [row[-1] + d[-1] if row else 0.0 for row, d in zip(starts, durations, strict=True)]
    return StreamTimes(starts, last_end, issue, begin, end, stall)
