"""The list-scheduling engine every cost-aware generator builds on.

A generator decides *which* op a rank runs next; the engine keeps everything else, once:

* **op encoding**: on a rank holding ``v`` chunks, pass ``c`` is the forward of chunk ``c`` and
  pass ``v + c`` its input-gradient backward (:func:`forward`, :func:`backward`); a deferred weight
  pass ``W`` is not a pass of its own: every ``B`` queues one (oldest first, :meth:`Engine.run_w`).
  Rows are built as :class:`~.ir.Op` lists, the schedule IR itself.
* **one clock**: an op starts when its rank is free and its input has arrived; an input made on
  another rank arrives ``T_comm`` after its producer ends, a local hand-off at once. That is the
  simulator's ``comm="async"`` model (:mod:`.timing`, what the executor does), so the times a
  generator decides with are the times the simulator reports.
* **memory** as the simulator counts it: an ``F`` adds one activation of its stage on its rank; with
  ``w_memory`` = 1 (default) the matching ``W`` frees it and ``B`` frees nothing; with a fraction ``f``
  (what a pending ``W`` really keeps, zero-bubble paper Table 1) ``B`` frees ``1 - f`` and ``W`` the rest.

The decisions are the generator's (its *policy*): which ready op runs next, when a ``W`` goes in,
when the warm-up stops admitting forwards. :meth:`Engine.earliest_first` is the plain driver (each
rank proposes its next op, the earliest runs); :func:`replay` times a fixed order with the same clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .costs import StageCosts
from .ir import Op, OpKind
from .placement import Placement

__all__ = ["Engine", "Timing", "backward", "forward", "replay"]

_KIND_F, _KIND_W = OpKind.F, OpKind.W
_op = tuple.__new__  # Op(kind, stage, microbatch) without the NamedTuple constructor's overhead


def forward(chunk: int, v: int) -> int:
    """Pass index of the forward of ``chunk`` on a rank with ``v`` chunks."""
    return chunk


def backward(chunk: int, v: int) -> int:
    """Pass index of the input-gradient backward of ``chunk`` on a rank with ``v`` chunks."""
    return v + chunk


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
    def key(self) -> tuple[float, float, int]:
        """Makespan, then the longest span, then the worst peak (rounded: ties are ties)."""
        return (round(self.makespan, 9), round(max(self.spans), 9), max(self.peaks))

    @property
    def bubble_rate(self) -> float:
        """``(C - W) / C`` with ``C`` the longest span and ``W`` the most busy time (zero-bubble paper)."""
        span = max(self.spans)
        return max(0.0, (span - max(self.busy)) / span) if span > 0 else 0.0


class Engine:
    """Per-rank op lists under construction, with the clock and memory of each rank.

    ``stage_of[r][c]`` is the stage of chunk ``c`` on rank ``r``; ``next[r][x]`` the next
    micro-batch of pass ``x``; ``f_end`` / ``b_end`` the end time of each stage's forward /
    backward per micro-batch (``-1``: not run yet); ``pending_w[r]`` the ``(stage, micro-batch)``
    whose ``W`` is still to run; ``live`` / ``peak`` activations held.
    """

    __slots__ = (
        "_b_frees", "_inputs", "_table", "_w_frees", "b_end", "busy", "clock", "count", "f_end", "first",
        "last_stage", "live", "m", "next", "p", "peak", "pending_w", "rank_of", "record", "rows", "sc", "stage_of",
        "total", "v",
    )  # fmt: skip

    def __init__(
        self,
        placement: Placement,
        m: int,
        costs: StageCosts,
        record: bool = True,
        w_memory: float = 1.0,
        start: Sequence[float] | None = None,
    ) -> None:
        p = placement.num_ranks
        v = placement.num_stages // p
        self.p, self.v, self.m, self.sc = p, v, m, costs
        self.last_stage = placement.num_stages - 1
        self.rank_of = [rank for rank, _ in placement.locations]
        self.stage_of = [[0] * v for _ in range(p)]
        for stage, (rank, chunk) in enumerate(placement.locations):
            self.stage_of[rank][chunk] = stage
        self.f_end = [[-1.0] * m for _ in range(placement.num_stages)]
        self.b_end = [[-1.0] * m for _ in range(placement.num_stages)]
        self.next = [[0] * (2 * v) for _ in range(p)]
        self.pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(p)]
        # w_memory = 1 keeps the counts integral (the default accounting, identical to before)
        self._w_frees: float = 1 if w_memory == 1 else float(w_memory)
        self._b_frees: float = 0 if w_memory == 1 else 1.0 - float(w_memory)
        self.live: list[float] = [0] * p
        self.peak: list[float] = [0] * p
        self.clock = [0.0] * p if start is None else [float(x) for x in start]
        self.first = [-1.0] * p
        self.busy = [0.0] * p
        self.rows: list[list[Op]] = [[] for _ in range(p)]
        self.count = [0] * p  # ops run per rank
        self.total = 3 * v * m  # ops of a rank
        self.record = record  # False: keep times only (replay), no rows
        # per rank and pass: (stage, op kind, duration, end times it writes, end times of its input, hop time)
        self._table: list[list[tuple[int, OpKind, float, list[float], list[float] | None, float]]] = []
        for r in range(p):
            row = []
            for which in range(2 * v):
                st = self.stage_of[r][which % v]
                src = self.producer(r, which)
                hop = costs.comm if src is not None and self.rank_of[src] != r else 0.0
                if which < v:
                    ends = None if src is None else self.f_end[src]
                    row.append((st, OpKind.F, costs.f[st], self.f_end[st], ends, hop))
                else:
                    ends = self.f_end[st] if src == st else self.b_end[src]  # type: ignore[index]
                    row.append((st, OpKind.B, costs.b[st], self.b_end[st], ends, hop))
            self._table.append(row)
        self._inputs = [[(ends, hop) for *_, ends, hop in row] for row in self._table]

    # ---- structure ---------------------------------------------------------------------------------
    def stage(self, r: int, which: int) -> int:
        return self.stage_of[r][which % self.v]

    def is_forward(self, which: int) -> bool:
        return which < self.v

    def producer(self, r: int, which: int) -> int | None:
        """Stage whose output pass ``which`` of rank ``r`` consumes (None: the data loader)."""
        s = self.stage(r, which)
        if which < self.v:
            return s - 1 if s > 0 else None
        return s + 1 if s < self.last_stage else s  # the last stage's B needs its own F

    def source(self, r: int, which: int) -> int | None:
        """Rank that sends this pass's input, or None for a local input."""
        src = self.producer(r, which)
        if src is None or self.rank_of[src] == r:
            return None
        return self.rank_of[src]

    def consumer(self, r: int, which: int) -> int | None:
        """Rank receiving this pass's output, if another rank."""
        s = self.stage(r, which)
        nxt = s + 1 if which < self.v else s - 1
        if not 0 <= nxt <= self.last_stage or self.rank_of[nxt] == r:
            return None
        return self.rank_of[nxt]

    def arrival(self, r: int, which: int) -> float | None:
        """When the input of rank ``r``'s next ``which`` pass is there (None: not produced yet)."""
        k = self.next[r][which]
        if k >= self.m:
            return None
        ends, hop = self._inputs[r][which]
        if ends is None:
            return 0.0  # the data loader's input, on the rank
        end = ends[k]
        return None if end < 0 else end + hop

    # ---- committing ops ----------------------------------------------------------------------------
    def run(self, r: int, which: int, start: float) -> None:
        """Run rank ``r``'s next ``which`` pass at ``start``."""
        s, kind, duration, ends, _, _ = self._table[r][which]
        k = self.next[r][which]
        self.next[r][which] = k + 1
        if self.first[r] < 0:
            self.first[r] = start
        ends[k] = self.clock[r] = start + duration
        self.busy[r] += duration
        self.count[r] += 1
        if self.record:
            self.rows[r].append(_op(Op, (kind, s, k)))
        if kind is _KIND_F:
            live = self.live[r] = self.live[r] + 1
            if live > self.peak[r]:
                self.peak[r] = live
        else:
            self.pending_w[r].append((s, k))
            if self._b_frees:
                self.live[r] -= self._b_frees

    def w_duration(self, r: int) -> float:
        """Duration of rank ``r``'s oldest deferred ``W`` (it must have one)."""
        return self.sc.w[self.pending_w[r][0][0]]

    def run_w(self, r: int, start: float | None = None) -> None:
        """Run rank ``r``'s oldest deferred ``W`` (at its clock by default); it frees the activation."""
        s, k = self.pending_w[r].popleft()
        start = self.clock[r] if start is None else start
        if self.first[r] < 0:  # pragma: no cover - a W always follows its B on the rank
            self.first[r] = start
        duration = self.sc.w[s]
        self.clock[r] = start + duration
        self.busy[r] += duration
        self.count[r] += 1
        if self.record:
            self.rows[r].append(_op(Op, (_KIND_W, s, k)))
        self.live[r] -= self._w_frees

    def earliest_first(self, choose: Callable[[int], tuple[float, int, int | None] | None]) -> bool:
        """The plain list-scheduling driver: each rank proposes ``choose(r) = (start, priority, pass)``
        (pass ``None``: its oldest deferred ``W``; ``None``: nothing it can run now); the earliest
        proposal runs, then its rank and the rank its output feeds propose again (a proposal depends
        only on its rank's state and its inputs). True if every rank ran all its ops."""
        p = self.p
        choice = [choose(r) for r in range(p)]
        while True:
            best: tuple[float, int, int | None] | None = None
            for q, pick in enumerate(choice):
                if pick is not None and (best is None or pick[0] < best[0]):
                    best = (pick[0], q, pick[2])
            if best is None:
                break
            t, r, which = best
            if which is None:
                self.run_w(r, t)
            else:
                self.run(r, which, t)
                q = self.consumer(r, which)
                if q is not None:  # the rank its output feeds
                    choice[q] = choose(q)
            choice[r] = choose(r)
        return all(self.done(r) for r in range(p))

    def done(self, r: int) -> bool:
        return self.count[r] >= self.total

    def timing(self) -> Timing:
        spans = tuple(self.clock[r] - max(self.first[r], 0.0) for r in range(self.p))
        return Timing(max(self.clock), spans, tuple(self.busy), tuple(self.peak), tuple(self.clock))


def replay(
    placement: Placement,
    m: int,
    costs: StageCosts,
    rows: Sequence[Sequence[Op]],
    *,
    w_memory: float = 1.0,
    start: Sequence[float] | None = None,
) -> Timing:
    """Time a fixed per-rank order on the engine's clock (each op as early as its rank and input
    allow); the engine's tables, run inline (it is the inner loop of every candidate's timing).
    ``start``: when each rank is free to begin (default 0); ``w_memory``: see :class:`Engine`."""
    eng = Engine(placement, m, costs, record=False, w_memory=w_memory, start=start)
    w_frees, b_frees = eng._w_frees, eng._b_frees
    p, v = eng.p, eng.v
    chunk_of = [c for _, c in placement.locations]
    w_time = costs.w
    pos, clock, first, busy, live, peak = [0] * p, eng.clock, eng.first, eng.busy, eng.live, eng.peak
    waiting: list[list[int]] = [[] for _ in range(p)]  # ranks blocked on what rank q will produce
    todo = list(range(p - 1, -1, -1))
    kind_w, kind_f = OpKind.W, OpKind.F
    while todo:
        r = todo.pop()
        row, table, k, t = rows[r], eng._table[r], pos[r], clock[r]
        lv, pk, bz = live[r], peak[r], busy[r]
        n = len(row)
        while k < n:
            kind, st, i = row[k]
            if kind is kind_w:
                duration = w_time[st]
                lv -= w_frees
            else:
                which = chunk_of[st] + (0 if kind is kind_f else v)
                _, _, duration, ends, inputs, hop = table[which]
                if inputs is not None:
                    end = inputs[i]
                    if end < 0:  # wait for the producer's rank (its own rank: the order deadlocks)
                        q = eng.rank_of[eng.producer(r, which)]  # type: ignore[index]
                        if q != r:
                            waiting[q].append(r)
                        break
                    if end + hop > t:
                        t = end + hop
                ends[i] = t + duration
                if kind is kind_f:
                    lv += 1
                    if lv > pk:
                        pk = lv
                elif b_frees:
                    lv -= b_frees
            if k == 0:
                first[r] = t
            t += duration
            bz += duration
            k += 1
        live[r], peak[r], busy[r] = lv, pk, bz
        pos[r], clock[r] = k, t
        todo.extend(waiting[r])
        waiting[r].clear()
    if any(pos[r] < len(rows[r]) for r in range(p)):
        raise AssertionError("replay: the order deadlocks")
    return eng.timing()
