"""V-ZB's greedy policy (see :mod:`.zbv`): ranks decide in time order on the engine's clock.

A free rank runs the best pass whose input has arrived: backwards first (the older micro-batch
first), then the chunk-1 forward (it completes a micro-batch's V), then a new micro-batch's forward
while the memory limit leaves room; otherwise a deferred ``W`` (with ``lazy_w`` only where it ends
before the next input arrives). With ``ordered`` it also keeps the messages between neighbouring
ranks in one order on both sides (:class:`Greedy`). The engine's :meth:`~..engine.Engine.by_clock`
drives it.
"""

from __future__ import annotations

from typing import NamedTuple

from ..engine import Engine, backward, forward
from ..order_timing import Timing
from ..placement import v_placement
from .common import ScheduleParameterError, StageCosts

__all__ = ["PB", "PF", "Greedy", "Pb", "Pf", "Policy"]

# The engine's passes on a V rank: chunk-0 forward, chunk-1 forward, chunk-0 backward, chunk-1 backward.
PF, Pf, Pb, PB = forward(0, 2), forward(1, 2), backward(0, 2), backward(1, 2)


class Policy(NamedTuple):
    """One variant of the V-ZB greedy."""

    ordered: bool  # keep messages between neighbours in one order (see :class:`Greedy`)
    lazy_w: bool  # run a deferred W in an idle gap only if it ends before the next input arrives
    #: with both backwards ready for the same micro-batch, run the chunk-0 one first. It never decides: when
    #: both may run, the chunk-0 backward's micro-batch is the older (it trails the chunk-1 one), which
    #: orders them first (benchmarks/RESULTS.md); kept as the recorded policy's field
    prefer_chunk0: bool
    #: non-empty: the handcrafted ZB-V list schedule (:func:`.zbv.handcrafted`) with this pass
    #: priority (``F``/``B`` of chunk 0/1 and ``W``, best first), ``+cap`` = warm-up-sized F0 lead
    handcrafted: str = ""
    #: non-empty: the round-built ZB-V (:func:`.zbv_rounds.build_rounds`); the passes (``F``, ``B``) a ``W``
    #: may delay when the gap before them would exceed the rank's idle allowance (``-``: none)
    rounds: str = ""


class Greedy(Engine):
    """One run of the list scheduler under one policy (see :func:`.zbv.v_zb_order`).

    Ranks decide in time order: a free rank runs the best pass whose input has arrived
    (backwards, then the chunk-1 forward, then a new micro-batch's forward if memory allows),
    else a deferred ``W``. Memory: a new micro-batch is admitted only with room left for the
    oldest pending chunk-1 forward, so the oldest micro-batch can always finish.

    With ``policy.ordered`` it also keeps the messages between two neighbouring ranks in the
    same order on both ranks: the lowering batches a rank's sends after an op with the receives
    before its next op and a batch waits for both sides (see :mod:`..lowering`), so two messages
    crossing in opposite directions cost nothing only if one rank receives the other's message in
    the batch where it sends its own; otherwise the lowering posts a receive early and the rank
    waits there. A pass that sends to a neighbour q then runs only if what q has sent so far can
    be received in that batch: by the rank's next pass, or by q's next pass when q's newest message
    came from its last pass; those next passes are fixed (``obliged``).
    """

    def __init__(self, p: int, m: int, sc: StageCosts, limit: int, policy: Policy) -> None:
        super().__init__(v_placement(p), m, sc)
        self.ordered, lazy_w, prefer_chunk0 = policy[:3]
        self.limit = limit
        self.lazy_w, self.prefer_chunk0 = lazy_w, prefer_chunk0
        # channel (src, dst) -> messages in send order, as (receiving pass, micro-batch); a prefix is received
        self.sent: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self.index: dict[tuple[int, int, int], int] = {}  # (dst, pass, mb) -> position on its channel
        self.received: dict[tuple[int, int], int] = {}
        self.obliged: list[int | None] = [None] * p  # the pass a rank must run next
        self.last_out: list[tuple[int, int] | None] = [None] * p  # (rank, channel index) its last pass sent
        self.violations = 0

    def _target(self, r: int, which: int) -> tuple[int, int] | None:
        """(rank, pass) receiving this pass's output, if another rank (on a V: the same pass)."""
        q = self.consumer(r, which)
        return None if q is None else (q, which)

    def _allowed(self, r: int, which: int, live: float | None = None, nxt: list[int] | None = None) -> bool:
        nxt = self.next[r] if nxt is None else nxt
        live = self.live[r] if live is None else live
        if nxt[which] >= self.m:
            return False
        if which == PF:  # admit a micro-batch only with room left for the oldest chunk-1 forward
            return live + 2 <= self.limit
        if which == Pf:
            return nxt[Pf] < nxt[PF] and live + 1 <= self.limit
        if which == PB:
            return nxt[PB] < nxt[Pf]
        return nxt[Pb] < nxt[PB]

    def _answer(self, r: int, which: int) -> tuple[int | None, tuple[int, int] | None] | None:
        """Keep message order consistent (class doc) if rank r runs ``which`` now.

        Returns the obligations it creates, ``(pass r must run next, (rank q, pass q must run
        next))`` with None for none, or None if the pass cannot run now."""
        target = self._target(r, which)
        if target is None or not self.ordered:
            return (None, None)
        q, then_q = target
        channel = (q, r)
        pending = self.sent.get(channel, ())
        unreceived = len(pending) - self.received.get(channel, 0)
        if unreceived <= 0:
            return (None, None)
        k = self.next[r][which]
        other: tuple[int, int] | None = None
        # q sent its newest message to r from its last pass: q can receive ours in the same batch
        if self.last_out[q] == (r, len(pending) - 1) and self.obliged[q] is None and self.next[q][then_q] == k:
            if self._allowed(q, then_q):
                other = (q, then_q)
                unreceived -= 1
        if unreceived == 0:
            return (None, other)
        # r's next pass receives (consumes, or posts in channel order) the rest
        then, k_then = pending[len(pending) - 1 - (1 if other is not None else 0)]
        nxt = list(self.next[r])
        nxt[which] += 1
        live = self.live[r] + (1 if which in (PF, Pf) else 0)
        if nxt[then] != k_then or not self._allowed(r, then, live, nxt):
            return None
        return (then, other)

    # ---- committing passes -------------------------------------------------------------------
    def _start(self, r: int, which: int, t: float, duties: tuple[int | None, tuple[int, int] | None] | None) -> None:
        k = self.next[r][which]
        source = self.source(r, which)
        if source is not None:  # receive (a receive also posts every earlier message of the channel)
            channel = (source, r)
            self.received[channel] = max(self.received.get(channel, 0), self.index[(r, which, k)] + 1)
        self.run(r, which, t)
        target = self._target(r, which)
        self.last_out[r] = None
        if target is not None:
            q, then_q = target
            queue = self.sent.setdefault((r, q), [])
            self.index[(q, then_q, k)] = len(queue)
            self.last_out[r] = (q, len(queue))
            queue.append((then_q, k))
        self.obliged[r] = None
        if duties is None:
            self.violations += 1  # ran anyway (an obligation, or the way out of a stall)
        else:
            self.obliged[r] = duties[0]
            if duties[1] is not None:
                self.obliged[duties[1][0]] = duties[1][1]

    def decide(self, r: int, force: bool = False) -> float | None:
        """Run one pass on rank ``r`` at its clock, or return when to try again (None = wait for a
        producer). ``force`` ignores message order (the way out when every rank would wait)."""
        t = self.clock[r]
        owed = self.obliged[r]
        if owed is not None:
            arrival = self.arrival(r, owed)
            if arrival is None or arrival > t:
                return arrival
            self._start(r, owed, t, self._answer(r, owed))
            return t
        ready: list[tuple[int, int, int, int]] = []  # (class, micro-batch, tie-break, pass)
        duties: dict[int, tuple[int | None, tuple[int, int] | None] | None] = {}
        soonest: float | None = None
        for which in (PB, Pb, Pf, PF):
            if not self._allowed(r, which):
                continue
            arrival = self.arrival(r, which)
            if arrival is None:
                continue
            if arrival > t:
                soonest = arrival if soonest is None else min(soonest, arrival)
                continue
            duties[which] = self._answer(r, which)
            if duties[which] is None and not force:
                continue
            k = self.next[r][which]
            if which in (PB, Pb):  # backwards first, the older micro-batch first
                ready.append((0, k, 0 if (which == Pb) == self.prefer_chunk0 else 1, which))
            else:  # then the chunk-1 forward (it completes a micro-batch's V), then admit a new one
                ready.append((1 if which == Pf else 2, k, 0, which))
        if ready:
            which = min(ready)[3]
            self._start(r, which, t, duties[which])
            return t
        if self.pending_w[r]:
            if not self.lazy_w or soonest is None or t + self.w_duration(r) <= soonest + 1e-12:
                self.run_w(r)
                self.last_out[r] = None
                return t
        return soonest

    def schedule(self) -> Timing:
        """Build the whole order (:meth:`~..engine.Engine.by_clock`); its timing."""
        self.by_clock(self.decide)
        if not all(self.done(r) for r in range(self.p)):  # pragma: no cover - the memory rule prevents it
            stuck = [r for r in range(self.p) if not self.done(r)]
            raise ScheduleParameterError(f"v-zb: internal error, ranks {stuck} cannot finish under the memory limit")
        return self.timing()
