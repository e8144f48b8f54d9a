"""The zero-bubble paper's automatic-schedule heuristic (Qi et al., ICLR 2024, section 3.1), as
round-based decisions on the list-scheduling engine; one of zb-auto's candidate families.

The paper builds the order one micro-batch at a time ("round" ``i``), ranks in pipeline order:

1. **Warm-up** (round 0): every rank runs ``F(0)``; then, from the last rank to the first, each
   rank admits extra forwards until the first backward is due back on it (``until_due``: the
   forward must *end* by then; else it may *start* up to then), within the memory limit. A rank
   keeps fewer warm-up forwards than the rank before it. The backwards of micro-batch 0 follow.
2. **Steady rounds** ``i >= 1``: each rank runs one more forward (a rank runs it only if the
   next rank does; ``hold_ahead``: a rank at least two forwards ahead of the next one skips it
   when the next rank is still busy long enough that waiting costs less than the worst
   bubble so far), then every rank from the last to the first runs ``B(i)``. Before each ``F``
   or ``B`` the rank runs deferred ``W`` passes: as many as the memory limit needs, then those
   that end before the op's input arrives, then (``fill_gap``) one more when the remaining gap
   is within the slack the worst rank's bubble leaves (always when it is larger).
3. **Tail**: rank 0 runs its pending ``W`` passes before its backwards once it has no forward
   left; every rank ends with its remaining ``W`` passes.

The three flags give the paper's eight policy variants (:data:`ROUND_VARIANTS`). Memory is the
engine's accounting (``w_memory``: the fraction of an activation a pending ``W`` keeps), so the
limit is the paper's when ``w_memory`` is its ``M_W / M_B``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ..engine import Engine
from ..ir import Op
from ..order_timing import Timing
from ..placement import loop_placement
from .common import StageCosts

__all__ = ["ROUND_VARIANTS", "RoundVariant", "rounds_order"]

_F, _B = 0, 1  # engine passes on a one-chunk rank
_EPS = 1e-9


@dataclass(frozen=True)
class RoundVariant:
    """One policy variant of :func:`rounds_order` (see the module doc for the three flags)."""

    until_due: bool
    hold_ahead: bool
    fill_gap: bool

    @property
    def name(self) -> str:
        return "rounds-" + "".join("1" if x else "0" for x in (self.until_due, self.hold_ahead, self.fill_gap))


ROUND_VARIANTS: tuple[RoundVariant, ...] = tuple(
    RoundVariant(*flags) for flags in itertools.product((True, False), repeat=3)
)


class _Rounds:
    """The engine plus the per-rank idle time the paper's slack rule reads."""

    def __init__(self, p: int, m: int, sc: StageCosts, limit: float, w_memory: float) -> None:
        self.eng = Engine(loop_placement(p), m, sc, w_memory=w_memory)
        self.p, self.m, self.sc, self.limit = p, m, sc, limit
        self.idle = [0.0] * p  # waiting for inputs after the rank's first forward

    def run(self, r: int, which: int) -> None:
        eng = self.eng
        at = eng.arrival(r, which)
        if at is None:  # pragma: no cover - every round schedules producers first
            raise AssertionError("zb-auto rounds: an input is not produced yet")
        start = max(eng.clock[r], at)
        if eng.next[r][_F] > 0:
            self.idle[r] += start - eng.clock[r]
        eng.run(r, which, start)

    def slack(self, r: int) -> float:
        """How much more idle time rank ``r`` may take before it becomes the worst rank."""
        return max(self.idle) - self.idle[r]

    def fits(self, r: int) -> bool:
        return self.eng.live[r] + 1 <= self.limit + _EPS

    def make_room(self, r: int) -> None:
        """Run ``W`` passes until one more activation fits (the limit is >= 1, so it always does)."""
        eng = self.eng
        while not self.fits(r):
            if not eng.pending_w[r]:
                raise ValueError("zb-auto rounds: the memory limit leaves no room for one activation")
            eng.run_w(r)

    def fill(self, r: int, which: int, fill_gap: bool) -> None:
        """``W`` passes that end before the input of rank ``r``'s next ``which`` pass arrives, then
        one more if the gap left is within the slack (or beyond it: a bubble either way)."""
        eng = self.eng
        at = eng.arrival(r, which)
        if at is None:  # pragma: no cover
            raise AssertionError("zb-auto rounds: an input is not produced yet")
        pending = eng.pending_w[r]
        while pending and eng.clock[r] + eng.w_duration(r) <= at:
            eng.run_w(r)
        if pending and eng.clock[r] < at and (fill_gap or at - eng.clock[r] > self.slack(r)):
            eng.run_w(r)


def rounds_order(
    p: int, m: int, sc: StageCosts, limit: float, variant: RoundVariant, w_memory: float = 1.0
) -> tuple[list[list[Op]], Timing]:
    """Rows and timing of one variant of the paper's heuristic (module doc) under ``limit``
    activations per rank (the engine's accounting with ``w_memory``)."""
    s = _Rounds(p, m, sc, limit, w_memory)
    eng = s.eng
    tf, tb, c = sc.f, sc.b, sc.comm
    nxt = eng.next
    # ---- round 0: F(0) down the pipeline, warm-up forwards, then B(0) back up ----
    for r in range(p):
        s.run(r, _F)
    extra = [0] * p
    due = eng.clock[p - 1] + tb[p - 1]  # when the last rank's B(0) ends
    for r in range(p - 2, -1, -1):
        live, t = eng.live[r], eng.clock[r]
        arrive = due + c
        while nxt[r][_F] + extra[r] < m and live + 1 <= limit + _EPS:
            if (t + tf[r] > arrive) if variant.until_due else (t >= arrive):
                break
            live += 1
            t += tf[r]
            extra[r] += 1
        due = max(t, arrive) + tb[r]
    for r in range(1, p):  # a rank keeps fewer warm-up forwards than the rank before it
        while extra[r] > 0 and extra[r] >= extra[r - 1] and nxt[r][_F] + extra[r] < m:
            extra[r] -= 1
    for r in range(p):
        for _ in range(extra[r]):
            s.run(r, _F)
    for r in range(p - 1, -1, -1):
        s.run(r, _B)
    # ---- rounds 1..m-1: one forward per rank (where the policy admits it), then B(i) back up ----
    for _round in range(1, m):
        want = [False] * p
        for r in range(p):
            if nxt[r][_F] >= m:
                continue
            if variant.hold_ahead and r + 1 < p and nxt[r][_F] >= nxt[r + 1][_F] + 2 and _hold(s, r):
                continue
            want[r] = True
        for r in range(p - 2, -1, -1):
            want[r] = want[r] and want[r + 1]
        for r in range(p):
            if want[r]:
                s.make_room(r)
                if r > 0:
                    s.fill(r, _F, variant.fill_gap)
                s.run(r, _F)
        for r in range(p - 1, -1, -1):
            if r + 1 < p:
                s.fill(r, _B, variant.fill_gap)
            if r == 0 and nxt[r][_F] >= m:
                while eng.pending_w[r]:
                    eng.run_w(r)
            s.run(r, _B)
    for r in range(p):
        while eng.pending_w[r]:
            eng.run_w(r)
    return eng.rows, eng.timing()


def _hold(s: _Rounds, r: int) -> bool:
    """``hold_ahead``: skip this round's forward on rank ``r`` (ahead of rank ``r+1``) when rank
    ``r+1`` needs longer for its next forward and backward than rank ``r`` for a forward plus the
    ``W`` passes that make room for it, and the wait is within the slack."""
    eng, sc = s.eng, s.sc
    down = eng.clock[r + 1] + sc.f[r + 1] + sc.b[r + 1] + sc.comm
    if eng.clock[r] >= down:
        return True
    room, extra_w, live = 0.0, 0, eng.live[r] + 1
    pending = eng.pending_w[r]
    while live > s.limit + _EPS and extra_w < len(pending):
        room += sc.w[pending[extra_w].stage]
        live -= eng._w_frees
        extra_w += 1
    if eng.clock[r] + sc.f[r] + room <= down:
        return False
    return down - eng.clock[r] <= s.slack(r)
