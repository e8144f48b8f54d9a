"""The one timing core: when each op of a per-rank order starts, under the simulator's model.

Every rank starts at 0 and runs its ops in order; an op starts when its rank is free and the
messages it waits for have arrived; a message is sent right after the op that makes it and
arrives its latency later. :func:`time_ops` is that loop, once; the options change what an op
waits for and what a rank runs besides its ops:

* ``waits[r][k]``: what op ``k`` of rank ``r`` waits for. Its own input message only is the
  ``comm="async"`` model (what the executor does, what the list-scheduling engine decides with);
  every receive of the batch the lowering placed before it is the ``comm="blocking"`` model.
* ``pairs``: overlap pairs (two ops run as one step that takes ``max + (1 - overlap) * min``, or a
  duration the caller gives per pair: the MoE two-stream model of :mod:`megatron_pp_ext.analysis.moe_comm`).
* ``collectives`` / ``gates``: one collective stream per rank (data parallelism, FSDP).

The callers are thin: :func:`op_start_times` and :func:`op_start_times_with_stream` time a lowered
schedule for :func:`megatron_pp_ext.analysis.simulate.simulate`; :func:`~.order_timing.replay` times a
generator's candidate order (its local hand-offs are messages of latency 0 to the same rank).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from .lowering import LoweredSchedule

__all__ = [
    "Iterations",
    "OpTimes",
    "op_start_times",
    "op_start_times_with_stream",
    "repeat_iterations",
    "time_ops",
]

_NOT_SENT, _AWAITED = -1.0, -2.0
Groups = Sequence[Sequence[tuple[int, ...] | None]]


class OpTimes(NamedTuple):
    """What :func:`time_ops` found, per rank."""

    starts: list[list[float]]  # start of each op in rank order
    last_end: list[float]  # end of the last op (0 for an empty rank)
    issue: list[list[float]]  # per collective (in issue order): when the rank reached its gap
    begin: list[list[float]]  # when it started on the stream
    end: list[list[float]]  # when it finished
    stall: list[float]  # time ops waited for a collective beyond their input and their rank


def time_ops(
    durations: Sequence[Sequence[float]],
    waits: Sequence[Sequence[int]] | Groups,
    sends: Sequence[Sequence[int]] | Groups,
    dst: Sequence[int],
    latency: Sequence[float],
    *,
    groups: bool = False,
    pairs: Sequence[Sequence[int]] = (),
    overlap: float = 0.0,
    pair_durations: Sequence[Mapping[int, float]] | None = None,
    pair_sends: Sequence[Mapping[int, tuple[float, float]]] | None = None,
    collectives: Sequence[Sequence[tuple[int, float]]] | None = None,
    gates: Sequence[Sequence[int]] | None = None,
    start: Sequence[float] | None = None,
) -> OpTimes:
    """Start of every op, per rank (module doc).

    ``durations[r][k]``: op ``k`` of rank ``r``. ``waits[r][k]``: the id of the one message it waits
    for (-1: none); ``sends[r][k]``: the id of the message sent right after it (-1: none). With
    ``groups`` both hold tuples of ids (None: none): every message the op waits for, every one sent
    after it. ``dst[mid]``: the rank receiving message ``mid``; ``latency[mid]``: from its send to
    its arrival. ``pairs[r]``: the first op of each overlap pair of rank ``r``, run as one step with
    ``overlap`` (0..1) of the shorter op hidden under the longer (:func:`_pair_steps`), or lasting
    ``pair_durations[r][i]`` when given (``i``: the pair's first op); a pair sends both outputs at its
    end, or, with ``pair_sends[r][i]`` (times from the pair's start), its first op's output and its
    second's each at its own time, a send never leaving before an earlier one to the same rank.
    ``collectives[r]``: ``(gap, duration)`` in issue order (gap ``i`` = just before op ``i``), issued
    when the rank reaches the gap and run one after another on the rank's stream, overlapping
    compute; ``gates[r][k]``: index in ``collectives[r]`` of the one op ``k`` waits for, -1 for none.
    ``start[r]``: when rank ``r`` is free to begin (default 0: one iteration alone); an empty rank
    ends at its start.

    Raises ``RuntimeError`` if some rank waits for a message that is never sent.
    Long because it is the timing core's single hot loop: splitting it would add calls on every op timed.
    """
    if (overlap or pair_durations is not None) and any(pairs):
        if collectives is not None:
            raise ValueError("overlap pairs are not timed with a collective stream")
        steps = _pair_steps(durations, waits, sends, groups, pairs, overlap, pair_durations)
        if pair_sends is not None and pair_durations is not None:
            latency = _early_sends(latency, sends, groups, pair_durations, pair_sends, dst)
        times = time_ops(*steps, dst, latency, groups=True, start=start)
        return times._replace(starts=[_unpair(row, firsts) for row, firsts in zip(times.starts, pairs, strict=True)])
    p = len(durations)
    arrival = [_NOT_SENT] * len(dst)
    starts: list[list[float]] = [[] for _ in range(p)]
    issue: list[list[float]] = [[] for _ in range(p)]
    begin: list[list[float]] = [[] for _ in range(p)]
    end: list[list[float]] = [[] for _ in range(p)]
    stall = [0.0] * p
    clock = [0.0] * p if start is None else [float(x) for x in start]
    begin_at = clock[:]
    free = clock[:]  # when each rank's collective stream is free
    pc = [0] * p
    stack = list(range(p - 1, -1, -1))
    while stack:
        rank = stack.pop()
        dur, wait, sent = durations[rank], waits[rank], sends[rank]
        colls = collectives[rank] if collectives is not None else None
        gate = gates[rank] if gates is not None else None
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
            need = wait[k]
            if groups:
                missing = False
                for mid in need or ():  # type: ignore[union-attr]
                    at = arrival[mid]
                    if at < 0:  # not sent yet: its sender resumes this rank
                        arrival[mid] = _AWAITED
                        missing = True
                    elif at > t:
                        t = at
                if missing:
                    break
            elif need >= 0:  # type: ignore[operator]
                at = arrival[need]  # type: ignore[index]
                if at < 0:  # not sent yet: its sender resumes this rank
                    arrival[need] = _AWAITED  # type: ignore[index]
                    break
                if at > t:
                    t = at
            if gate is not None:
                g = gate[k]
                if g >= 0 and end[rank][g] > t:
                    stall[rank] += end[rank][g] - t
                    t = end[rank][g]
            add_start(t)
            t += dur[k]
            out = sent[k]
            if groups:
                for mid in out or ():  # type: ignore[union-attr]
                    if arrival[mid] < 0:  # sent once; a rank waiting for it resumes
                        if arrival[mid] == _AWAITED:
                            stack.append(dst[mid])
                        arrival[mid] = t + latency[mid]
            elif out >= 0 and arrival[out] < 0:  # type: ignore[operator,index]
                if arrival[out] == _AWAITED:  # type: ignore[index]
                    stack.append(dst[out])  # type: ignore[index]
                arrival[out] = t + latency[out]  # type: ignore[index]
            k += 1
        pc[rank], clock[rank] = k, t
    stuck = [r for r in range(p) if pc[r] < len(durations[r])]
    if stuck:
        raise RuntimeError(f"simulation stuck: ranks {stuck} wait for messages that are never sent")
    last_end = [clock[r] if starts[r] else begin_at[r] for r in range(p)]
    return OpTimes(starts, last_end, issue, begin, end, stall)


def _as_group(x: object, groups: bool) -> tuple[int, ...]:
    if groups:
        return x or ()  # type: ignore[return-value]
    return (x,) if x >= 0 else ()  # type: ignore[operator,return-value]


def _pair_steps(
    durations: Sequence[Sequence[float]],
    waits: Sequence[Sequence[int]] | Groups,
    sends: Sequence[Sequence[int]] | Groups,
    groups: bool,
    pairs: Sequence[Sequence[int]],
    overlap: float,
    pair_durations: Sequence[Mapping[int, float]] | None = None,
) -> tuple[list[list[float]], list[list[tuple[int, ...]]], list[list[tuple[int, ...]]]]:
    """Per rank, its ops as steps: an overlap pair (ops ``i``, ``i+1``) is one step that starts once
    both inputs are there, takes ``max + (1 - overlap) * min`` of the two durations (or
    ``pair_durations[rank][i]``) and sends both outputs at its end (unless :func:`_early_sends` moves
    them); other ops are steps of their own.
    Waits and sends as groups."""
    out_d: list[list[float]] = []
    out_w: list[list[tuple[int, ...]]] = []
    out_s: list[list[tuple[int, ...]]] = []
    for rank, dur in enumerate(durations):
        first = set(pairs[rank]) if rank < len(pairs) else set()
        d: list[float] = []
        w: list[tuple[int, ...]] = []
        s: list[tuple[int, ...]] = []
        k = 0
        while k < len(dur):
            width = 2 if k in first else 1
            if width == 2 and pair_durations is not None:
                d.append(pair_durations[rank][k])
            elif width == 2:
                a, b = dur[k], dur[k + 1]
                d.append(max(a, b) + (1.0 - overlap) * min(a, b))
            else:
                d.append(dur[k])
            w.append(tuple(mid for j in range(k, k + width) for mid in _as_group(waits[rank][j], groups)))
            s.append(tuple(mid for j in range(k, k + width) for mid in _as_group(sends[rank][j], groups)))
            k += width
        out_d.append(d)
        out_w.append(w)
        out_s.append(s)
    return out_d, out_w, out_s


def _early_sends(
    latency: Sequence[float],
    sends: Sequence[Sequence[int]] | Groups,
    groups: bool,
    pair_durations: Sequence[Mapping[int, float]],
    pair_sends: Sequence[Mapping[int, tuple[float, float]]],
    dst: Sequence[int],
) -> list[float]:
    """Latencies counted from the end of each message's step: a pair's output that leaves before the
    pair's end arrives that much sooner. The second op's output to a rank the first op also sends to
    leaves no earlier than the first's (one channel keeps its order)."""
    out = list(latency)
    for rank, pairs in enumerate(pair_sends):
        for i, (first_out, second_out) in pairs.items():
            duration = pair_durations[rank][i]
            firsts = _as_group(sends[rank][i], groups)
            for mid in firsts:
                out[mid] -= duration - first_out
            to = {dst[mid] for mid in firsts}
            for mid in _as_group(sends[rank][i + 1], groups):
                out[mid] -= duration - (max(first_out, second_out) if dst[mid] in to else second_out)
    return out


def _unpair(step_starts: list[float], firsts: Sequence[int]) -> list[float]:
    """Op starts from step starts: both ops of a pair start with their step."""
    out: list[float] = []
    first = set(firsts)
    for start in step_starts:
        out.append(start)
        if len(out) - 1 in first:
            out.append(start)
    return out


def op_start_times(
    lowered: LoweredSchedule,
    durations: Sequence[list[float]],
    t_comm: float,
    *,
    blocking: bool = False,
    overlap: float = 0.0,
    pair_durations: Sequence[Mapping[int, float]] | None = None,
    pair_sends: Sequence[Mapping[int, tuple[float, float]]] | None = None,
    start: Sequence[float] | None = None,
) -> tuple[list[list[float]], list[float]]:
    """``(starts, last_end)`` of a lowered schedule (:func:`time_ops`): per rank the start of each
    op in rank order, and the end of its last op (0 for an empty rank). ``blocking=False`` (what
    the executor does): an op waits only for its own input; ``blocking=True``: a rank waits at each
    batch of receives the lowering placed (possibly early, see :mod:`.lowering`) until all arrived.
    ``overlap`` (0..1, non-blocking only): the schedule's overlap pairs run as one step each.
    ``pair_durations`` (non-blocking only): the duration of each pair instead, ``pair_sends`` when its
    outputs leave (:func:`time_ops`).
    ``start[r]``: when rank ``r`` is free to begin (default 0: one iteration alone).

    Raises ``RuntimeError`` if some rank waits for a message that never comes (a lowering that
    :func:`~megatron_pp_ext.analysis.schedule_check.validate` would reject).
    """
    plan = lowered.timing_plan
    pairs = lowered.schedule.overlap_pairs if overlap or pair_durations is not None else ()
    if pairs and blocking:
        raise ValueError("overlap pairs are timed with non-blocking receives only")
    latency = [t_comm] * plan.num_messages
    if blocking:  # every receive of the batch before an op, as groups (sends too)
        sends = [[(mid,) if mid >= 0 else None for mid in row] for row in plan.sends_after_ops]
        times = time_ops(durations, plan.receive_groups, sends, plan.dst_rank, latency, groups=True, start=start)
    else:
        times = time_ops(
            durations,
            plan.inputs_of_ops,
            plan.sends_after_ops,
            plan.dst_rank,
            latency,
            pairs=pairs,
            overlap=overlap,
            pair_durations=pair_durations,
            pair_sends=pair_sends,
            start=start,
        )
    return times.starts, times.last_end


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
        plan.inputs_of_ops,
        plan.sends_after_ops,
        plan.dst_rank,
        latency,
        collectives=collectives,
        gates=gate,
    )
