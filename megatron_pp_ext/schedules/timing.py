"""The one timing core: when each op of a per-rank order starts, under the simulator's model.

Every rank starts at 0 and runs its ops in order; an op starts when its rank is free and the
messages it waits for have arrived; a message is sent right after the op that makes it and
arrives its latency later. :func:`time_ops` is that loop, once; the options change what an op
waits for and what a rank runs besides its ops:

* ``waits[r][k]``: the messages op ``k`` of rank ``r`` waits for. Its own input only is the
  ``comm="async"`` model (what the executor does, what the list-scheduling engine decides with);
  every receive of the batch the lowering placed before it is the ``comm="blocking"`` model.
* ``pairs``: overlap pairs (two ops run as one step that takes ``max + (1 - overlap) * min``).
* ``collectives`` / ``gates``: one collective stream per rank (data parallelism, FSDP).

The callers are thin: :func:`op_start_times` and :func:`op_start_times_with_stream` time a lowered
schedule for :func:`megatron_pp_ext.analysis.simulate.simulate`; :func:`~.engine.replay` times a
generator's candidate order (its local hand-offs are messages of latency 0 to the same rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from .lowering import LoweredSchedule

__all__ = ["OpTimes", "StreamTimes", "op_start_times", "op_start_times_with_stream", "time_ops"]

_NOT_SENT, _AWAITED = -1.0, -2.0
Waits = Sequence[Sequence[tuple[int, ...] | None]]


class OpTimes(NamedTuple):
    """What :func:`time_ops` found, per rank."""

    starts: list[list[float]]  # start of each op in rank order
    last_end: list[float]  # end of the last op (0 for an empty rank)
    issue: list[list[float]]  # per collective (in issue order): when the rank reached its gap
    begin: list[list[float]]  # when it started on the stream
    end: list[list[float]]  # when it finished
    stall: list[float]  # time ops waited for a collective beyond their input and their rank


StreamTimes = OpTimes  # the name :func:`op_start_times_with_stream` returned before the core was shared


def time_ops(
    durations: Sequence[Sequence[float]],
    waits: Waits,
    sends: Sequence[Sequence[int]],
    dst: Sequence[int],
    latency: Sequence[float],
    *,
    pairs: Sequence[Sequence[int]] = (),
    overlap: float = 0.0,
    collectives: Sequence[Sequence[tuple[int, float]]] | None = None,
    gates: Sequence[Sequence[int]] | None = None,
) -> OpTimes:
    """Start of every op, per rank (module doc).

    ``durations[r][k]``: op ``k`` of rank ``r``. ``waits[r][k]``: ids of the messages it waits for
    (None: none). ``sends[r][k]``: id of the message sent right after it (-1: none). ``dst[mid]``:
    the rank receiving message ``mid``; ``latency[mid]``: from its send to its arrival.
    ``pairs[r]``: the first op of each overlap pair of rank ``r``, run as one step with ``overlap``
    (0..1) of the shorter op hidden under the longer; both outputs leave at the step's end.
    ``collectives[r]``: ``(gap, duration)`` in issue order (gap ``i`` = just before op ``i``), issued
    when the rank reaches the gap and run one after another on the rank's stream, overlapping
    compute; ``gates[r][k]``: index in ``collectives[r]`` of the one op ``k`` waits for, -1 for none.

    Raises ``RuntimeError`` if some rank waits for a message that is never sent.
    """
    p = len(durations)
    arrival = [_NOT_SENT] * len(dst)
    starts: list[list[float]] = [[] for _ in range(p)]
    issue: list[list[float]] = [[] for _ in range(p)]
    begin: list[list[float]] = [[] for _ in range(p)]
    end: list[list[float]] = [[] for _ in range(p)]
    stall = [0.0] * p
    free = [0.0] * p  # when each rank's collective stream is free
    clock = [0.0] * p
    pc = [0] * p
    paired = [bytearray(len(row)) for row in durations] if overlap and any(pairs) else None
    if paired is not None:
        for rank, row in enumerate(pairs):
            for i in row:
                paired[rank][i] = 1
    no_colls: Sequence[tuple[int, float]] = ()
    stack = list(range(p - 1, -1, -1))
    while stack:
        rank = stack.pop()
        dur, wait, sent = durations[rank], waits[rank], sends[rank]
        colls = collectives[rank] if collectives is not None else no_colls
        gate = gates[rank] if gates is not None else None
        pair = paired[rank] if paired is not None else None
        n = len(dur)
        k, t = pc[rank], clock[rank]
        add_start = starts[rank].append
        while True:
            if colls:  # issue what the rank reached (once)
                c = len(issue[rank])
                while c < len(colls) and colls[c][0] <= k:
                    at = free[rank] if free[rank] > t else t
                    free[rank] = at + colls[c][1]
                    issue[rank].append(t)
                    begin[rank].append(at)
                    end[rank].append(free[rank])
                    c += 1
            if k >= n:
                break
            width = 2 if pair is not None and pair[k] else 1
            ready, blocked = t, False
            for j in range(k, k + width):
                group = wait[j]
                if group is not None:
                    for mid in group:
                        at = arrival[mid]
                        if at < 0:  # not sent yet: its sender resumes this rank
                            arrival[mid] = _AWAITED
                            blocked = True
                        elif at > ready:
                            ready = at
            if blocked:
                break
            if gate is not None:
                g = gate[k]
                if g >= 0 and end[rank][g] > ready:
                    stall[rank] += end[rank][g] - ready
                    ready = end[rank][g]
            t = ready
            add_start(t)
            if width == 2:
                a, b = dur[k], dur[k + 1]
                add_start(t)
                t += max(a, b) + (1.0 - overlap) * min(a, b)
            else:
                t += dur[k]
            for j in range(k, k + width):
                mid = sent[j]
                if mid >= 0:
                    if arrival[mid] == _AWAITED:
                        stack.append(dst[mid])
                    if arrival[mid] < 0:
                        arrival[mid] = t + latency[mid]
            k += width
        pc[rank], clock[rank] = k, t
    stuck = [r for r in range(p) if pc[r] < len(durations[r])]
    if stuck:
        raise RuntimeError(f"simulation stuck: ranks {stuck} wait for messages that are never sent")
    last_end = [clock[r] if starts[r] else 0.0 for r in range(p)]
    return OpTimes(starts, last_end, issue, begin, end, stall)


def _own_input(lowered: LoweredSchedule) -> list[list[tuple[int, ...] | None]]:
    """Per op, the one message that brings its input (the async model's wait)."""
    return [[None if mid < 0 else (mid,) for mid in row] for row in lowered.timing_plan.inputs_of_ops]


def op_start_times(
    lowered: LoweredSchedule,
    durations: Sequence[list[float]],
    t_comm: float,
    *,
    blocking: bool = False,
    overlap: float = 0.0,
) -> tuple[list[list[float]], list[float]]:
    """``(starts, last_end)`` of a lowered schedule (:func:`time_ops`): per rank the start of each
    op in rank order, and the end of its last op (0 for an empty rank). ``blocking=False`` (what
    the executor does): an op waits only for its own input; ``blocking=True``: a rank waits at each
    batch of receives the lowering placed (possibly early, see :mod:`.lowering`) until all arrived.
    ``overlap`` (0..1, non-blocking only): the schedule's overlap pairs run as one step each.

    Raises ``RuntimeError`` if some rank waits for a message that never comes (a lowering that
    :func:`~megatron_pp_ext.analysis.validate.validate` would reject).
    """
    plan = lowered.timing_plan
    pairs = lowered.schedule.overlap_pairs if overlap else ()
    if pairs and blocking:
        raise ValueError("overlap pairs are timed with non-blocking receives only")
    waits = plan.receive_groups if blocking else _own_input(lowered)
    latency = [t_comm] * plan.num_messages
    times = time_ops(durations, waits, plan.sends_after_ops, plan.dst_rank, latency, pairs=pairs, overlap=overlap)
    return times.starts, times.last_end


def op_start_times_with_stream(
    lowered: LoweredSchedule,
    durations: Sequence[list[float]],
    t_comm: float,
    collectives: Sequence[Sequence[tuple[int, float]]],
    gate: Sequence[Sequence[int]],
) -> OpTimes:
    """:func:`op_start_times` (non-blocking receives) plus one collective stream per rank
    (``collectives`` and ``gate`` as in :func:`time_ops`)."""
    plan = lowered.timing_plan
    latency = [t_comm] * plan.num_messages
    return time_ops(
        durations,
        _own_input(lowered),
        plan.sends_after_ops,
        plan.dst_rank,
        latency,
        collectives=collectives,
        gates=gate,
    )
