"""Timing a finished per-rank order on the engine's clock (the simulator's async model), with the one
timing core (:func:`.timing.time_ops`): :func:`order_times` (every op's start), :func:`replay` (the
:class:`Timing` a generator ranks candidates by), :func:`post_validated_time` and :func:`span_key` (zb-auto's
``span`` objective: iterations back to back with optimizer post-validation).

An order under construction is timed op by op by :class:`.engine.Engine` with the same rule
(``tests/schedules/test_engine.py`` checks the two agree to the bit).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from .costs import StageCosts
from .ir import Op, OpKind
from .placement import Placement
from .timing import OpTimes, repeat_iterations, time_ops

__all__ = ["SPAN_ITERATIONS", "Timing", "order_times", "post_validated_time", "replay", "span_key"]

#: Back-to-back iterations :func:`post_validated_time` times an order over (zb-auto's ``span`` objective).
SPAN_ITERATIONS = 3

_KIND_F, _KIND_W = OpKind.F, OpKind.W


@dataclass(frozen=True)
class Timing:
    """What a built order takes on the engine's clock: makespan, per-rank spans (first op start to
    last op end), busy time, peak live activations (in stage activations) and per-rank end of the
    last op (``ends``)."""

    makespan: float
    spans: tuple[float, ...]
    busy: tuple[float, ...]
    peaks: tuple[float, ...]
    ends: tuple[float, ...] = ()

    @property
    def key(self) -> tuple[float, float, float]:
        """Makespan, then the longest span, then the worst peak (rounded: ties are ties)."""
        return (round(self.makespan, 9), round(max(self.spans), 9), max(self.peaks))

    @property
    def bubble_rate(self) -> float:
        """``(C - W) / C`` with ``C`` the longest span and ``W`` the most busy time (zero-bubble paper)."""
        span = max(self.spans)
        return max(0.0, (span - max(self.busy)) / span) if span > 0 else 0.0


def order_times(
    placement: Placement,
    m: int,
    costs: StageCosts,
    rows: Sequence[Sequence[Op]],
    *,
    start: Sequence[float] | None = None,
) -> OpTimes:
    """Time a fixed per-rank order with the timing core (:func:`.timing.time_ops`, the simulator's
    async model): each op as early as its rank and input allow. Every output is a message (to the
    consumer's rank, ``T_comm`` later; a local hand-off to the same rank at once), so an order in
    which a rank waits for something it runs later raises ``RuntimeError``."""
    return _time_order(placement, m, costs, rows, start=start)[0]


def replay(
    placement: Placement,
    m: int,
    costs: StageCosts,
    rows: Sequence[Sequence[Op]],
    *,
    w_memory: float = 1.0,
    start: Sequence[float] | None = None,
) -> Timing:
    """The :class:`Timing` of a fixed per-rank order on the engine's clock (:func:`order_times`).
    ``start``: when each rank is free to begin (default 0); ``w_memory``: see :class:`.engine.Engine`."""
    try:
        times, busy, peaks = _time_order(placement, m, costs, rows, w_memory=w_memory, start=start)
    except RuntimeError:
        raise AssertionError("replay: the order deadlocks") from None
    spans = tuple(end - row[0] if row else 0.0 for row, end in zip(times.starts, times.last_end, strict=True))
    return Timing(max(times.last_end, default=0.0), spans, tuple(busy), tuple(peaks), tuple(times.last_end))


def post_validated_time(
    placement: Placement,
    m: int,
    costs: StageCosts,
    rows: Sequence[Sequence[Op]],
    iterations: int = SPAN_ITERATIONS,
) -> float:
    """Time per iteration of a fixed order run back to back with optimizer post-validation (no step
    synchronisation, :func:`.timing.repeat_iterations`), on the engine's clock: the notion the
    simulator's ``iterations`` report."""

    def run_once(start: list[float]) -> tuple[float, ...]:
        return replay(placement, m, costs, rows, start=start).ends

    return repeat_iterations(run_once, placement.num_ranks, iterations, post_validation=True).time


def span_key(
    placement: Placement, m: int, costs: StageCosts, rows: Sequence[Sequence[Op]], timing: Timing
) -> tuple[float, ...]:
    """How the ``span`` objective ranks a candidate order (``timing``: its :func:`replay`): the
    post-validated time per iteration, then the longest per-rank span, then ``timing.key``."""
    return (round(post_validated_time(placement, m, costs, rows), 9), round(max(timing.spans), 9), *timing.key)


@lru_cache(maxsize=32)
def _messages(placement: Placement, m: int, hop: float) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """Per message id ``2 (stage m + micro-batch) + is-backward``: the rank receiving it and its latency
    (``hop`` across ranks, 0 for a hand-off on the rank); shared by every order timed on one layout."""
    stages = placement.num_stages
    rank_of = [rank for rank, _ in placement.locations]
    last = stages - 1
    dst = [0] * (2 * stages * m)
    for s in range(stages):
        to_f, to_b = rank_of[s + 1] if s < last else rank_of[s], rank_of[s - 1] if s > 0 else rank_of[s]
        dst[2 * s * m : 2 * (s + 1) * m : 2] = [to_f] * m
        dst[2 * s * m + 1 : 2 * (s + 1) * m : 2] = [to_b] * m
    latency = tuple(0.0 if dst[mid] == rank_of[mid // (2 * m)] else hop for mid in range(len(dst)))
    return tuple(dst), latency


def _time_order(
    placement: Placement,
    m: int,
    costs: StageCosts,
    rows: Sequence[Sequence[Op]],
    *,
    w_memory: float = 1.0,
    start: Sequence[float] | None = None,
) -> tuple[OpTimes, list[float], list[float]]:
    """:func:`order_times`, plus per rank its busy time and peak live activations."""
    stages = placement.num_stages
    last = stages - 1
    dst, latency = _messages(placement, m, costs.comm)
    # per op kind and stage: (duration, id of its input message for micro-batch 0 or -1, the same for
    # its output, live activations it adds); w_memory as in :class:`.engine.Engine` (1: integral counts)
    w_frees: float = 1 if w_memory == 1 else float(w_memory)
    b_frees: float = 0 if w_memory == 1 else 1.0 - float(w_memory)
    table: dict[OpKind, list[tuple[float, int, int, float]]] = {
        _KIND_F: [(costs.f[s], 2 * (s - 1) * m if s > 0 else -1, 2 * s * m, 1) for s in range(stages)],
        _KIND_W: [(costs.w[s], -1, -1, -w_frees) for s in range(stages)],
    }
    table[OpKind.B] = table[OpKind.BW] = [
        (costs.b[s], 2 * (s + 1) * m + 1 if s < last else 2 * s * m, 2 * s * m + 1 if s > 0 else -1, -b_frees)
        for s in range(stages)
    ]
    durations, waits, sends, busy, peaks = [], [], [], [], []
    for row in rows:
        dur: list[float] = []
        wait: list[int] = []
        send: list[int] = []
        total, live, peak = 0.0, 0.0, 0.0
        for kind, s, i in row:
            d, need, out, grows = table[kind][s]
            dur.append(d)
            wait.append(need + 2 * i if need >= 0 else -1)
            send.append(out + 2 * i if out >= 0 else -1)
            total += d  # in order, as the rank runs them (sum()'s rounding may differ)
            if grows:
                live += grows
                if live > peak:
                    peak = live
        durations.append(dur)
        waits.append(wait)
        sends.append(send)
        busy.append(total)
        peaks.append(peak)
    return time_ops(durations, waits, sends, dst, latency, start=start), busy, peaks
