"""The list-scheduling engine every cost-aware generator builds on.

A generator decides *which* op a rank runs next; the engine keeps everything else, once:

* **op encoding**: on a rank holding ``v`` chunks, pass ``c`` is the forward of chunk ``c`` and
  pass ``v + c`` its input-gradient backward (:func:`forward`, :func:`backward`); a deferred weight
  pass ``W`` is not a pass of its own: every ``B`` queues one (oldest first, :meth:`Engine.run_w`).
  Rows are built as :class:`~.ir.Op` lists, the schedule IR itself.
* **one clock**: an op starts when its rank is free and its input has arrived; an input made on
  another rank arrives ``T_comm`` after its producer ends, a local hand-off at once. That is the
  simulator's ``comm="async"`` model, so the times a generator decides with are the times the
  simulator reports. A finished order is timed by the one timing core (:func:`.timing.time_ops`,
  which the simulator uses too) through :mod:`.order_timing` (``order_times``, ``replay``); while an
  order is being built, :meth:`Engine.arrival` and :meth:`Engine.run` apply the same rule one op at a time
  (``tests/schedules/test_engine.py`` checks the two agree to the bit).
* **memory** as the simulator counts it: an ``F`` adds one activation of its stage on its rank; with
  ``w_memory`` = 1 (default) the matching ``W`` frees it and ``B`` frees nothing; with a fraction ``f``
  (what a pending ``W`` really keeps, zero-bubble paper Table 1) ``B`` frees ``1 - f`` and ``W`` the rest.

The decisions are the generator's (its *policy*): which ready op runs next, when a ``W`` goes in,
when the warm-up stops admitting forwards. Two drivers: :meth:`Engine.earliest_first` (each rank
proposes its next op, the earliest runs) and :meth:`Engine.by_clock` (ranks decide in order of their
clocks, waking the rank their output feeds); :func:`pass_op`, :func:`input_of` and :func:`output_of`
translate between passes, ops and their neighbours.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence

from .costs import StageCosts
from .ir import Op, OpKind, op_grid
from .order_timing import Timing
from .placement import Placement

__all__ = ["Engine", "backward", "forward", "input_of", "output_of", "pass_op"]

_KIND_F, _KIND_W = OpKind.F, OpKind.W
# a pass of one rank: (its ops by micro-batch, the W ops a backward defers or None, duration, end times it writes,
# end times of its input, hop time)
_Entry = tuple[tuple[Op, ...], tuple[Op, ...] | None, float, list[float], list[float] | None, float]
_op = tuple.__new__  # Op(kind, stage, microbatch) without the NamedTuple constructor's overhead


def forward(chunk: int, v: int) -> int:
    """Pass index of the forward of ``chunk`` on a rank with ``v`` chunks."""
    return chunk


def backward(chunk: int, v: int) -> int:
    """Pass index of the input-gradient backward of ``chunk`` on a rank with ``v`` chunks."""
    return v + chunk


def pass_op(stages: Sequence[int], which: int, k: int, weight: bool = False) -> Op:
    """The op of pass ``which`` for micro-batch ``k`` on a rank holding ``stages`` (one per chunk);
    ``weight``: the deferred ``W`` of that (backward) pass."""
    v = len(stages)
    kind = _KIND_F if which < v else _KIND_W if weight else OpKind.B
    return _op(Op, (kind, stages[which % v], k))


def input_of(op: Op, last_stage: int) -> Op | None:
    """The op whose output ``op`` consumes (None: the data loader's): a forward the previous stage's,
    a backward the next stage's (the last stage's its own forward), a ``W`` its own ``B``."""
    kind, s, _ = op
    if kind is _KIND_F:
        return op._replace(stage=s - 1) if s > 0 else None
    if kind is _KIND_W:
        return op._replace(kind=OpKind.B)
    return op._replace(stage=s + 1) if s < last_stage else op._replace(kind=_KIND_F)


def output_of(op: Op, last_stage: int) -> Op | None:
    """The op that consumes ``op``'s output across a stage boundary or the turn of the last stage
    (None for a ``W`` and the first stage's backward)."""
    kind, s, _ = op
    if kind is _KIND_F:
        return op._replace(stage=s + 1) if s < last_stage else op._replace(kind=OpKind.B)
    if kind is _KIND_W:
        return None
    return op._replace(stage=s - 1) if s > 0 else None


class Engine:
    """Per-rank op lists under construction, with the clock and memory of each rank.

    ``stage_of[r][c]`` is the stage of chunk ``c`` on rank ``r``; ``next[r][x]`` the next
    micro-batch of pass ``x``; ``f_end`` / ``b_end`` the end time of each stage's forward /
    backward per micro-batch (``-1``: not run yet); ``pending_w[r]`` the deferred ``W`` ops still to
    run, oldest first; ``live`` / ``peak`` activations held.
    """

    __slots__ = (
        "_b_frees", "_inputs", "_table", "_w_frees", "b_end", "clock", "count", "f_end", "first", "last_stage",
        "live", "m", "next", "p", "peak", "pending_w", "rank_of", "rows", "sc", "stage_of", "total", "v",
    )  # fmt: skip

    def __init__(
        self,
        placement: Placement,
        m: int,
        costs: StageCosts,
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
        self.pending_w: list[deque[Op]] = [deque() for _ in range(p)]
        # w_memory = 1 keeps the counts integral (the default accounting, identical to before)
        self._w_frees: float = 1 if w_memory == 1 else float(w_memory)
        self._b_frees: float = 0 if w_memory == 1 else 1.0 - float(w_memory)
        self.live: list[float] = [0] * p
        self.peak: list[float] = [0] * p
        self.clock = [0.0] * p if start is None else [float(x) for x in start]
        self.first = [-1.0] * p
        self.rows: list[list[Op]] = [[] for _ in range(p)]
        self.count = [0] * p  # ops run per rank
        self.total = 3 * v * m  # ops of a rank
        # per rank and pass (_Entry); the ops are shared (ir.op_grid)
        stages = placement.num_stages
        f_ops, b_ops, w_ops = (op_grid(kind, stages, m) for kind in (OpKind.F, OpKind.B, OpKind.W))
        self._table: list[list[_Entry]] = []
        for r in range(p):
            row: list[_Entry] = []
            for which in range(2 * v):
                st = self.stage_of[r][which % v]
                src = self.producer(r, which)
                hop = costs.comm if src is not None and self.rank_of[src] != r else 0.0
                if which < v:
                    ends = None if src is None else self.f_end[src]
                    row.append((f_ops[st], None, costs.f[st], self.f_end[st], ends, hop))
                else:
                    ends = self.f_end[st] if src == st else self.b_end[src]  # type: ignore[index]
                    row.append((b_ops[st], w_ops[st], costs.b[st], self.b_end[st], ends, hop))
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
        ops, w_ops, duration, ends, _, _ = self._table[r][which]
        nxt = self.next[r]
        k = nxt[which]
        nxt[which] = k + 1
        clock = self.clock
        if self.first[r] < 0:
            self.first[r] = start
        ends[k] = clock[r] = start + duration
        self.count[r] += 1
        self.rows[r].append(ops[k])
        if w_ops is None:  # a forward
            live = self.live
            now = live[r] = live[r] + 1
            if now > self.peak[r]:
                self.peak[r] = now
        else:
            self.pending_w[r].append(w_ops[k])
            if self._b_frees:
                self.live[r] -= self._b_frees

    def run_asap(self, r: int, which: int) -> bool:
        """Run rank ``r``'s next ``which`` pass as soon as its rank is free and its input is there;
        False if it has none left or its input is not made yet."""
        arrival = self.arrival(r, which)
        if arrival is None:
            return False
        self.run(r, which, max(self.clock[r], arrival))
        return True

    def w_duration(self, r: int) -> float:
        """Duration of rank ``r``'s oldest deferred ``W`` (it must have one)."""
        return self.sc.w[self.pending_w[r][0][1]]

    def run_w(self, r: int, start: float | None = None) -> None:
        """Run rank ``r``'s oldest deferred ``W`` (at its clock by default); it frees the activation."""
        op = self.pending_w[r].popleft()
        self.clock[r] = (self.clock[r] if start is None else start) + self.sc.w[op[1]]
        self.count[r] += 1
        self.rows[r].append(op)
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
                fed = self.consumer(r, which)
                if fed is not None:  # the rank its output feeds
                    choice[fed] = choose(fed)
            choice[r] = choose(r)
        return all(self.done(r) for r in range(p))

    def by_clock(self, decide: Callable[[int, bool], float | None]) -> None:
        """The event-driven driver: ranks decide in order of their clocks. ``decide(r, force)`` runs
        at most one op on rank ``r`` at its clock and returns when to ask again (None: when a
        producer has run). A rank that ran an op wakes the rank its output feeds, one hop later.
        When every rank waits, each unfinished rank is asked again with ``force`` (earliest clock
        first) until one runs or says when, and the driver goes on; it stops when none can."""
        p, total, inf = self.p, self.total, math.inf
        wake = [0.0] * p  # when each rank next decides; inf = waits for a producer
        heap = [(0.0, r) for r in range(p)]

        def step(r: int, force: bool) -> bool:
            """Let rank r decide at its clock; True if it ran an op or will decide again."""
            before = self.count[r]
            again = decide(r, force)
            if self.count[r] > before:
                q = self.receiver(r, self.rows[r][-1])
                if q is not None and self.count[q] < total:
                    when = max(self.clock[q], self.clock[r] + self.sc.comm)
                    if when < wake[q]:
                        wake[q] = when
                        heapq.heappush(heap, (when, q))
                again = self.clock[r]
            if self.count[r] >= total or again is None:
                wake[r] = inf
                return self.count[r] > before
            wake[r] = max(again, self.clock[r])
            heapq.heappush(heap, (wake[r], r))
            return True

        while True:
            while heap:
                t, r = heapq.heappop(heap)
                if t != wake[r]:
                    continue  # superseded
                self.clock[r] = max(self.clock[r], t)
                step(r, False)
            waiting = sorted((r for r in range(p) if self.count[r] < total), key=lambda x: self.clock[x])
            if not waiting or not any(step(r, True) for r in waiting):
                break

    def receiver(self, r: int, op: Op) -> int | None:
        """The rank waiting for ``op``'s output, if another rank."""
        out = output_of(op, self.last_stage)
        return None if out is None or self.rank_of[out.stage] == r else self.rank_of[out.stage]

    def done(self, r: int) -> bool:
        return self.count[r] >= self.total

    def timing(self) -> Timing:
        spans = tuple(self.clock[r] - max(self.first[r], 0.0) for r in range(self.p))
        return Timing(max(self.clock), spans, self.busy_times(), tuple(self.peak), tuple(self.clock))

    def busy_times(self) -> tuple[float, ...]:
        """Per rank, the durations of the ops run so far, summed in the order the rank ran them."""
        by_kind = {_KIND_F: self.sc.f, OpKind.B: self.sc.b, _KIND_W: self.sc.w}
        busy = []
        for row in self.rows:
            total = 0.0
            for kind, s, _ in row:
                total += by_kind[kind][s]
            busy.append(total)
        return tuple(busy)
