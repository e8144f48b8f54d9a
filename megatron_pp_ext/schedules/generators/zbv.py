"""V-ZB: the zero-bubble paper's ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024)
on the V placement (see :mod:`.vshape`), within a memory limit.

``v-zb`` runs ZB-V on the V placement, never holding more than ``memory_limit`` (in ``M_a``;
default ``p``, 1F1B's peak) on a rank. It times the passes with the given costs (``t_f``,
``t_b``, ``t_w``: a number or one per stage; ``t_comm`` per hop; read from any object that has
them, e.g. ``analysis.simulate.Costs``; unit costs by default) and tries the schedules of
:data:`POLICIES`, keeping the one that runs fastest as the executor runs it (the simulator's
async model, in which the lowering's batched exchanges make no rank wait beyond its own inputs;
the ``ordered`` greedy policies also keep messages in one order for the blocking model).
First, ZB-V built round by round as the
zero-bubble authors' generator builds it (:class:`_Rounds`): a fixed warm-up of forwards, then
rounds of one backward and one forward per rank with deferred ``W`` passes where the memory
needs them or a wait leaves room, rebuilt with each rank's idle time from the previous build as
its allowance while that helps. With the default limit it is exactly zero bubble at
``T_F = T_B = T_W`` once ``m >= 2p - 1`` (checked for p = 2..32) with peak exactly ``p`` M_a,
and the search stops there, as nothing can end sooner. Otherwise it also tries a greedy list
scheduler (backwards as soon as their inputs arrive, then chunk-1 forwards, a new micro-batch
while memory allows, deferred ``W`` passes in idle time) and the paper's handcrafted ZB-V as
fixed-priority list schedules. ``params["ideal_bubble_rate"]`` is the bubble when every pass
starts as soon as its input exists, ``params["predicted_bubble_rate"]`` the one the lowered
program gives (what the simulator and the runtime see).

The constructions run on the list-scheduling engine (:mod:`..engine`: op encoding, the simulator's
async clock, memory); this module keeps their decisions, and times every candidate with the engine's
:func:`~..engine.replay` (tests cross-check it against ``analysis.simulate``).
"""

from __future__ import annotations

import heapq
import math
from typing import NamedTuple

from ..capabilities import MemoryLimit, check_request
from ..engine import Engine, Timing, backward, forward, replay
from ..ir import Op, OpKind
from ..placement import v_placement
from ..registry import ScheduleInfo, register
from ..schedule import Schedule, build_schedule
from .common import ScheduleParameterError, StageCosts, check_int, stage_costs
from .vshape import v_capabilities

__all__ = ["POLICIES", "Policy", "VZBTiming", "v_zb", "v_zb_order"]


V_ZB = v_capabilities(
    memory_limit=MemoryLimit(
        "M_a",
        "1F1B-stage activations (M_a)",
        1,
        why="a rank holds both V-stage activations of a micro-batch, M_a/2 each, from its forwards to its weight "
        "passes",
    ),
    costs=True,
)


def _v_memory_limit(limit: object, p: int) -> int:
    """``memory_limit`` (in M_a = two V-stage activations) as whole V-stage activations (default ``2p``)."""
    if limit is None:
        return 2 * p
    check_request("v-zb", V_ZB, p, 1, {"memory_limit": limit})
    assert isinstance(limit, int | float)
    return 1 << 62 if math.isinf(limit) else math.floor(2 * limit + 1e-9)


#: Timing of an order (peaks in V-stage activations, M_a / 2): the engine's.
VZBTiming = Timing

# The engine's passes on a V rank: chunk-0 forward, chunk-1 forward, chunk-0 backward, chunk-1 backward.
_PF, _Pf, _Pb, _PB = forward(0, 2), forward(1, 2), backward(0, 2), backward(1, 2)


class _Greedy(Engine):
    """One run of the list scheduler under one policy (see :func:`v_zb_order`).

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

    def _allowed(self, r: int, which: int, live: int | None = None, nxt: list[int] | None = None) -> bool:
        nxt = self.next[r] if nxt is None else nxt
        live = self.live[r] if live is None else live
        if nxt[which] >= self.m:
            return False
        if which == _PF:  # admit a micro-batch only with room left for the oldest chunk-1 forward
            return live + 2 <= self.limit
        if which == _Pf:
            return nxt[_Pf] < nxt[_PF] and live + 1 <= self.limit
        if which == _PB:
            return nxt[_PB] < nxt[_Pf]
        return nxt[_Pb] < nxt[_PB]

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
        live = self.live[r] + (1 if which in (_PF, _Pf) else 0)
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
        for which in (_PB, _Pb, _Pf, _PF):
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
            if which in (_PB, _Pb):  # backwards first, the older micro-batch first
                ready.append((0, k, 0 if (which == _Pb) == self.prefer_chunk0 else 1, which))
            else:  # then the chunk-1 forward (it completes a micro-batch's V), then admit a new one
                ready.append((1 if which == _Pf else 2, k, 0, which))
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

    def schedule(self) -> VZBTiming:
        p, m = self.p, self.m
        total = 6 * m
        inf = math.inf
        wake = [0.0] * p  # when each rank next decides; inf = waits for a producer
        heap = [(0.0, r) for r in range(p)]

        def step(r: int, force: bool) -> bool:
            """Let rank r decide at its clock; True if it ran a pass or will decide again."""
            before = len(self.rows[r])
            again = self.decide(r, force)
            if len(self.rows[r]) > before:
                q = self._consumer_rank(r, self.rows[r][-1])
                if q is not None and len(self.rows[q]) < total:
                    when = max(self.clock[q], self.clock[r] + self.sc.comm)
                    if when < wake[q]:
                        wake[q] = when
                        heapq.heappush(heap, (when, q))
                again = self.clock[r]
            if len(self.rows[r]) >= total or again is None:
                wake[r] = inf
                return len(self.rows[r]) > before
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
            waiting = sorted((r for r in range(p) if len(self.rows[r]) < total), key=lambda x: self.clock[x])
            # every rank waits on a message order it cannot keep: the earliest that can run breaks it
            if not waiting or not any(step(r, True) for r in waiting):
                break
        if any(len(row) < total for row in self.rows):  # pragma: no cover - the memory rule prevents it
            stuck = [r for r in range(p) if len(self.rows[r]) < total]
            raise ScheduleParameterError(f"v-zb: internal error, ranks {stuck} cannot finish under the memory limit")
        return self.timing()

    def _consumer_rank(self, r: int, op: Op) -> int | None:
        """The rank waiting for ``op``'s output, if another rank."""
        if op.kind is OpKind.W:
            return None
        nxt = op.stage + 1 if op.kind is OpKind.F else op.stage - 1
        if not 0 <= nxt <= self.last_stage or self.rank_of[nxt] == r:
            return None
        return self.rank_of[nxt]


class Policy(NamedTuple):
    """One variant of the V-ZB greedy."""

    ordered: bool  # keep messages between neighbours in one order (see :class:`_Greedy`)
    lazy_w: bool  # run a deferred W in an idle gap only if it ends before the next input arrives
    prefer_chunk0: bool  # with both backwards ready (same micro-batch), run the chunk-0 one first
    #: non-empty: the handcrafted ZB-V list schedule (:func:`_zbv_handcrafted`) with this pass
    #: priority (``F``/``B`` of chunk 0/1 and ``W``, best first), ``+cap`` = warm-up-sized F0 lead
    handcrafted: str = ""
    #: non-empty: the round-built ZB-V (:func:`_zbv_rounds`); the passes (``F``, ``B``) a ``W``
    #: may delay when the gap before them would exceed the rank's idle allowance (``-``: none)
    rounds: str = ""


#: Variants v-zb tries; it keeps the one whose lowered program runs fastest, and stops early once
#: one cannot be beaten (see :func:`v_zb_order`), so the round-built ZB-V comes first. (Preferring
#: the chunk-1 backward never won on a grid of p, m, costs and limits, so it is not tried.)
POLICIES = (
    tuple(Policy(False, False, True, rounds=fill) for fill in ("F B", "F", "B", "-"))
    + tuple(Policy(ordered, lazy, True) for ordered in (False, True) for lazy in (False, True))
    + tuple(Policy(False, False, True, h) for h in ("B0 F0 F1 B1 W +cap", "F0 F1 B0 B1 W +cap", "B0 B1 F1 W F0"))
)


def _zbv_handcrafted(p: int, m: int, sc: StageCosts, limit: int, spec: str) -> tuple[list[list[Op]], VZBTiming] | None:
    """ZB-V (zero-bubble paper) as a fixed-priority list schedule, or None if it stalls.

    Each rank, when free, runs the ready pass (input arrived) that comes first in ``spec``'s
    priority; a deferred ``W`` (oldest first) is always ready and fills gaps. Like the paper's
    warm-up, a new micro-batch (chunk-0 forward) is admitted only with room for its chunk-1
    forward within ``limit`` V-stage activations, and with ``+cap`` rank ``r`` runs at most
    ``2p-1-2r`` chunk-0 forwards ahead of its chunk-1 forwards (the warm-up count: what arrives
    before the first chunk-1 input), which keeps the steady state at the repeating
    F/B/W pattern with every rank busy (zero bubble at ``T_F = T_B = T_W`` once ``m >= 2p``).
    """
    names = spec.split()
    cap = "+cap" in names
    passes = {"F0": _PF, "F1": _Pf, "B0": _Pb, "B1": _PB, "W": None}
    order = [passes[n] for n in names if n != "+cap"]
    eng = Engine(v_placement(p), m, sc)
    nxt, live, clock, pending = eng.next, eng.live, eng.clock, eng.pending_w

    def arrival(r: int, which: int) -> float | None:
        """When rank r's next ``which`` pass could start by its input, if the policy allows it now."""
        n = nxt[r]
        if which == _PF:  # admit a micro-batch: room for its chunk-1 forward, and the warm-up cap
            if live[r] + 2 > limit or (cap and n[_PF] - n[_Pf] >= max(1, 2 * p - 1 - 2 * r)):
                return None
        elif which == _Pf:
            if n[_Pf] >= n[_PF] or live[r] + 1 > limit:
                return None
        elif n[which] >= n[_Pf if which == _PB else _PB]:  # B1 after F1, B0 after B1
            return None
        return eng.arrival(r, which)

    def choose(r: int) -> tuple[float, int, int | None] | None:
        """Rank r's next pass: (start, priority, pass or None for W): the earliest start, then the priority."""
        if eng.done(r):
            return None
        cands = []
        for rank_of, which in enumerate(order):
            if which is None:
                if pending[r]:
                    cands.append((clock[r], rank_of, which))
                continue
            at = arrival(r, which)
            if at is not None:
                cands.append((max(clock[r], at), rank_of, which))
        if not cands:
            return None
        start = min(x[0] for x in cands)
        return min((x for x in cands if x[0] <= start + 1e-12), key=lambda x: x[1])

    if not eng.earliest_first(choose):
        return None
    return eng.rows, eng.timing()


class _Rounds(_Greedy):
    """ZB-V built round by round, as the zero-bubble authors' own ZB-V generator builds it (Qi
    et al., "Zero Bubble Pipeline Parallelism", ICLR 2024), with every pass timed by the given
    costs as soon as its input has arrived and its rank is free.

    * Warm-up: every rank runs micro-batch 0's chunk-0 forward; then, from the last rank up,
      rank ``r`` runs more chunk-0 forwards (the ranks above it, which feed it, run one each
      too) while they end before its first chunk-1 input arrives and leave room for the
      ``2r + 1`` activations it still has to take in, then its first chunk-1 forward. At the
      default limit rank ``r`` so runs ``2p - 1 - 2r`` chunk-0 forwards, the paper's warm-up.
    * Fill: for ``r = 1 .. p-1``, rank ``r`` and the ranks below it run forwards of alternating
      chunks until rank ``r`` has run as many forwards as rank ``r - 1`` and more chunk-1 ones
      (at the default limit and ``m >= 2p`` every rank then holds ``2p`` activations).
    * Rounds: each rank runs one backward (the chunk-0 one once its input exists, else the
      chunk-1 one; the chunk-0 ones from the last rank up, then the chunk-1 ones from the
      first rank down, so that inputs are made before they are used), then one forward (the
      chunk-1 one if its input exists, else a new micro-batch's), after a deferred ``W`` when
      the memory is full. So in the steady state every rank repeats ``B``, ``W``, ``F`` and,
      at ``T_F = T_B = T_W``, never waits. A ``W`` also goes into a wait for an input when it
      fits there, and, if ``policy.rounds`` names the pass (``F``, ``B``; always before a
      chunk-0 backward), when the wait would make the rank idle longer than the worst rank
      so far, or than its slack in ``approved`` (an earlier run's idle times: a rank that
      idled less then may idle more now).
    """

    def __init__(
        self, p: int, m: int, sc: StageCosts, limit: int, policy: Policy, approved: tuple[float, ...] | None
    ) -> None:
        super().__init__(p, m, sc, limit, policy)
        self.fill_f, self.fill_b = "F" in policy.rounds, "B" in policy.rounds
        self.idle = [0.0] * p  # per rank, after its first pass
        self.slack = [0.0] * p if approved is None else [max(approved) - a for a in approved]

    def _put(self, r: int, which: int) -> bool:
        """Run rank r's next ``which`` pass as early as possible; False if it cannot run yet."""
        k = self.next[r][which]
        if k >= self.m or (which in (_PF, _Pf) and self.live[r] >= self.limit):
            return False
        arrival = self.arrival(r, which)
        if arrival is None:
            return False
        start = max(self.clock[r], arrival)
        if self.first[r] >= 0:
            self.idle[r] += start - self.clock[r]
        self.run(r, which, start)
        return True

    def _put_w(self, r: int) -> None:
        self.run_w(r)

    def _fill(self, r: int, which: int, may_delay: bool) -> None:
        """Deferred ``W`` passes before ``which``: those that fit in the wait for its input, and
        one more that delays it if ``may_delay`` and the wait exceeds the rank's allowance."""
        pending = self.pending_w[r]
        arrival = self.arrival(r, which) if self.next[r][which] < self.m else None
        if arrival is None:
            return
        while pending and self.clock[r] + self.w_duration(r) <= arrival:
            self._put_w(r)
        allowance = max(max(self.idle), self.slack[r]) - self.idle[r]
        if pending and may_delay and arrival - self.clock[r] > allowance:
            self._put_w(r)

    def _backward(self, r: int) -> int | None:
        n = self.next[r]
        local = r == self.p - 1 or n[_PB] >= self.m
        if n[_Pb] < n[_PB] and (local or self.arrival(r, _Pb) is not None):
            return _Pb
        return _PB if n[_PB] < self.m else None

    def _forward(self, r: int) -> int | None:
        n = self.next[r]
        if n[_Pf] >= self.m:
            return None
        if n[_Pf] >= n[_PF]:
            return _PF
        if r == self.p - 1 or self.arrival(r, _Pf) is not None:
            return _Pf
        return _PF if n[_PF] < self.m and self.arrival(r, _PF) is not None else None

    def _warm_up(self) -> bool:
        p, m, sc = self.p, self.m, self.sc
        if not all(self._put(r, _PF) for r in range(p)):
            return False
        for r in reversed(range(p)):
            target = self.arrival(r, _Pf) if r < p - 1 else self.clock[r]
            assert target is not None  # rank r+1 ran micro-batch 0's chunk-1 forward just before
            while (
                self.live[r] + 2 * (r + 1) <= self.limit
                and self.clock[r] + sc.f[r] <= target
                and all(self.next[q][_PF] < m for q in range(r + 1))
            ):
                if not all(self._put(q, _PF) for q in range(r + 1)):
                    return False
            if not self._put(r, _Pf):
                return False
        chunk = _PF
        for r in range(1, p):
            while sum(self.next[r][:2]) < sum(self.next[r - 1][:2]) or (self.next[r][_Pf] <= self.next[r - 1][_Pf] < m):
                for q in reversed(range(r, p)):
                    if self.next[q][chunk] < m and not self._put(q, chunk):
                        return False
                chunk = _Pf if chunk == _PF else _PF
        return True

    def _round(self) -> bool:
        """One backward and one forward per rank (where possible); False if nothing ran."""
        p = self.p
        choice = [self._backward(r) for r in range(p)]
        order = [r for r in reversed(range(p)) if choice[r] == _Pb] + [r for r in range(p) if choice[r] == _PB]
        ran = False
        for r in order:
            which = choice[r]
            assert which is not None
            self._fill(r, which, which == _Pb or self.fill_b)
            ran = self._put(r, which) or ran
        for r in range(p):
            which = self._forward(r)
            if which is None:
                continue
            while self.live[r] >= self.limit and self.pending_w[r]:
                self._put_w(r)
            self._fill(r, which, self.fill_f)
            ran = self._put(r, which) or ran
        return ran

    def build(self) -> VZBTiming | None:
        """Build the schedule into ``rows``; its timing, or None if the construction stalls."""
        p, total = self.p, 6 * self.m
        if not self._warm_up():
            return None
        while any(self.next[r][_Pb] < self.m for r in range(p)):
            if not self._round():
                return None
        for r in range(p):
            while self.pending_w[r]:
                self._put_w(r)
        if any(len(row) < total for row in self.rows):
            return None
        return self.timing()


def _zbv_rounds(p: int, m: int, sc: StageCosts, limit: int, policy: Policy) -> tuple[list[list[Op]], VZBTiming] | None:
    """The round-built ZB-V (:class:`_Rounds`), rebuilt with the previous run's idle times as
    the approved slack while that shortens it (the paper's generator does the same); None if
    the construction stalls (e.g. under a tight memory limit)."""
    best: tuple[tuple[float, float], list[list[Op]], VZBTiming] | None = None
    approved: tuple[float, ...] | None = None
    while True:
        built = _Rounds(p, m, sc, limit, policy, approved)
        timing = built.build()
        if timing is None:
            break
        key = (round(max(timing.spans), 9), round(timing.makespan, 9))
        if best is not None and key >= best[0]:
            break
        best = (key, built.rows, timing)
        approved = tuple(built.idle)
    return None if best is None else (best[1], best[2])


def _timing_of_lowered(schedule: Schedule, sc: StageCosts) -> VZBTiming:
    """Time the order the way the runtime runs its lowered program: the engine's clock
    (:func:`..engine.replay`) is the simulator's default ``comm="async"`` model, in which a compute
    op waits for its own input only, so the lowering's message batches cost nothing extra."""
    return replay(schedule.placement, schedule.num_microbatches, sc, schedule.ops)


def _candidate(p: int, m: int, sc: StageCosts, limit: int, policy: Policy) -> tuple[list[list[Op]], VZBTiming] | None:
    """One policy's per-rank orders and ideal timing, or None if it stalls."""
    if policy.rounds:
        return _zbv_rounds(p, m, sc, limit, policy)
    if policy.handcrafted:
        return _zbv_handcrafted(p, m, sc, limit, policy.handcrafted)
    greedy = _Greedy(p, m, sc, limit, policy)
    ideal = greedy.schedule()
    return greedy.rows, ideal


def _unbeatable(p: int, m: int, sc: StageCosts) -> tuple[float, float]:
    """A floor on any schedule's (makespan, longest span): rank ``r`` starts no earlier than micro-batch
    0's forward reaches it and then has its passes to run; a span holds at least its rank's passes."""
    busy = [m * sum(c[s] for c in (sc.f, sc.b, sc.w) for s in (r, 2 * p - 1 - r)) for r in range(p)]
    reach = [sum(sc.f[:r]) + r * sc.comm for r in range(p)]
    return (round(max(a + b for a, b in zip(reach, busy, strict=True)), 9), round(max(busy), 9))


def v_zb_order(
    p: int, m: int, costs: object = None, memory_limit: object = None
) -> tuple[list[list[Op]], VZBTiming, VZBTiming, Policy]:
    """The V-ZB per-rank orders, their timing as lowered (what the runtime and the simulator see),
    their ideal timing (each pass starts once its input exists) and the chosen :class:`Policy`:
    the best of :data:`POLICIES` by lowered makespan, then the longest per-rank span (the first
    one that reaches :func:`_unbeatable`'s floor ends the search)."""
    check_int("p", p, 2)
    check_int("m", m, 1)
    sc = stage_costs(costs, 2 * p)
    limit = _v_memory_limit(memory_limit, p)
    placement = v_placement(p)
    floor = _unbeatable(p, m, sc)
    best: tuple[tuple[float, float], list[list[Op]], VZBTiming, VZBTiming, Policy] | None = None
    for policy in POLICIES:
        made = _candidate(p, m, sc, limit, policy)
        if made is None:
            continue
        rows, ideal = made
        if best is not None and (policy.rounds or policy.handcrafted) and round(ideal.makespan, 9) > best[0][0]:
            continue  # it times every pass as early as its input allows: lowered, it can only end later
        timing = _timing_of_lowered(build_schedule("v-zb", placement, m, rows), sc)
        key = (round(timing.makespan, 9), round(max(timing.spans), 9))
        if best is None or key < best[0]:
            best = (key, rows, timing, ideal, policy)
            if key <= floor:
                break
    assert best is not None
    return best[1], best[2], best[3], best[4]


def v_zb(
    p: int,
    m: int,
    *,
    costs: object = None,
    memory_limit: float | None = None,
) -> Schedule:
    """V-ZB (ZB-V): greedy on the V placement within ``memory_limit`` M_a (default ``p``)."""
    rows, timing, ideal, policy = v_zb_order(p, m, costs, memory_limit)
    return build_schedule(
        "v-zb",
        v_placement(p),
        m,
        rows,
        memory_limit=memory_limit if memory_limit is not None else p,
        policy=policy._asdict(),
        predicted_makespan=timing.makespan,
        predicted_bubble_rate=timing.bubble_rate,
        ideal_bubble_rate=ideal.bubble_rate,
    )


register(
    ScheduleInfo(
        "v-zb",
        v_zb,
        "v",
        True,
        "",
        "ZB-V: zero-bubble V schedule within memory_limit (1F1B-stage units; default p = 1F1B's peak)",
        family="v-shape",
        capabilities=V_ZB,
    )
)
