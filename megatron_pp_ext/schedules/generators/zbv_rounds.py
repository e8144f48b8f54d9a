"""V-ZB built round by round, as the zero-bubble authors' own ZB-V generator builds it (see :mod:`.zbv`).

A fixed warm-up of forwards, a fill that evens the ranks' forward counts, then rounds of one
backward and one forward per rank, with deferred ``W`` passes where the memory needs them or a wait
leaves room; :func:`build_rounds` rebuilds it with each rank's idle time from the previous build as
its allowance while that helps. Every pass runs on the engine's clock (:meth:`~..engine.Engine.run_asap`).
"""

from __future__ import annotations

from ..ir import Op
from ..order_timing import Timing
from .common import StageCosts
from .zbv_greedy import PB, PF, Greedy, Pb, Pf, Policy

__all__ = ["Rounds", "build_rounds"]


class Rounds(Greedy):
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
        self.slack = [0.0] * p if approved is None else [max(approved) - a for a in approved]
        self.idle = [0.0] * p  # per rank, waits after its first op

    def run(self, r: int, which: int, start: float) -> None:
        if self.first[r] >= 0:
            self.idle[r] += start - self.clock[r]
        super().run(r, which, start)

    def _put(self, r: int, which: int) -> bool:
        """Run rank r's next ``which`` pass as early as possible; False if it cannot run yet."""
        if which in (PF, Pf) and self.live[r] >= self.limit:
            return False
        return self.run_asap(r, which)

    def _fill(self, r: int, which: int, may_delay: bool) -> None:
        """Deferred ``W`` passes before ``which``: those that fit in the wait for its input, and
        one more that delays it if ``may_delay`` and the wait exceeds the rank's allowance."""
        pending = self.pending_w[r]
        arrival = self.arrival(r, which) if self.next[r][which] < self.m else None
        if arrival is None:
            return
        while pending and self.clock[r] + self.w_duration(r) <= arrival:
            self.run_w(r)
        allowance = max(max(self.idle), self.slack[r]) - self.idle[r]
        if pending and may_delay and arrival - self.clock[r] > allowance:
            self.run_w(r)

    def _backward(self, r: int) -> int | None:
        n = self.next[r]
        local = r == self.p - 1 or n[PB] >= self.m
        if n[Pb] < n[PB] and (local or self.arrival(r, Pb) is not None):
            return Pb
        return PB if n[PB] < self.m else None

    def _forward(self, r: int) -> int | None:
        n = self.next[r]
        if n[Pf] >= self.m:
            return None
        if n[Pf] >= n[PF]:
            return PF
        if r == self.p - 1 or self.arrival(r, Pf) is not None:
            return Pf
        return PF if n[PF] < self.m and self.arrival(r, PF) is not None else None

    def _warm_up(self) -> bool:
        p, m, sc = self.p, self.m, self.sc
        if not all(self._put(r, PF) for r in range(p)):
            return False
        for r in reversed(range(p)):
            target = self.arrival(r, Pf) if r < p - 1 else self.clock[r]
            assert target is not None  # rank r+1 ran micro-batch 0's chunk-1 forward just before
            while (
                self.live[r] + 2 * (r + 1) <= self.limit
                and self.clock[r] + sc.f[r] <= target
                and all(self.next[q][PF] < m for q in range(r + 1))
            ):
                if not all(self._put(q, PF) for q in range(r + 1)):
                    return False
            if not self._put(r, Pf):
                return False
        chunk = PF
        for r in range(1, p):
            while sum(self.next[r][:2]) < sum(self.next[r - 1][:2]) or (self.next[r][Pf] <= self.next[r - 1][Pf] < m):
                for q in reversed(range(r, p)):
                    if self.next[q][chunk] < m and not self._put(q, chunk):
                        return False
                chunk = Pf if chunk == PF else PF
        return True

    def _round(self) -> bool:
        """One backward and one forward per rank (where possible); False if nothing ran."""
        p = self.p
        choice = [self._backward(r) for r in range(p)]
        order = [r for r in reversed(range(p)) if choice[r] == Pb] + [r for r in range(p) if choice[r] == PB]
        ran = False
        for r in order:
            which = choice[r]
            assert which is not None
            self._fill(r, which, which == Pb or self.fill_b)
            ran = self._put(r, which) or ran
        for r in range(p):
            which = self._forward(r)
            if which is None:
                continue
            while self.live[r] >= self.limit and self.pending_w[r]:
                self.run_w(r)
            self._fill(r, which, self.fill_f)
            ran = self._put(r, which) or ran
        return ran

    def build(self) -> Timing | None:
        """Build the schedule into ``rows``; its timing, or None if the construction stalls."""
        p, total = self.p, 6 * self.m
        if not self._warm_up():
            return None
        while any(self.next[r][Pb] < self.m for r in range(p)):
            if not self._round():
                return None
        for r in range(p):
            while self.pending_w[r]:
                self.run_w(r)
        if any(len(row) < total for row in self.rows):
            return None
        return self.timing()


def build_rounds(p: int, m: int, sc: StageCosts, limit: int, policy: Policy) -> tuple[list[list[Op]], Timing] | None:
    """The round-built ZB-V (:class:`Rounds`), rebuilt with the previous run's idle times as
    the approved slack while that shortens it (the paper's generator does the same); None if
    the construction stalls (e.g. under a tight memory limit)."""
    best: tuple[tuple[float, float], list[list[Op]], Timing] | None = None
    approved: tuple[float, ...] | None = None
    while True:
        built = Rounds(p, m, sc, limit, policy, approved)
        timing = built.build()
        if timing is None:
            break
        key = (round(max(timing.spans), 9), round(timing.makespan, 9))
        if best is not None and key >= best[0]:
            break
        best = (key, built.rows, timing)
        approved = tuple(built.idle)
    return None if best is None else (best[1], best[2])
