"""zb-auto's greedy list scheduler (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024): one pass
builds a one-chunk order over the given costs under an activation limit; :class:`GreedyVariant` holds the
policy flags a pass runs with (zb-auto tries :data:`DEFAULT_VARIANTS`; ZB-H2's order is the pass with the
default flags at unit costs).

The pass runs on the list-scheduling engine (:class:`..engine.Engine`: its clock, op encoding and memory
count). Its driver is its own rather than :meth:`..engine.Engine.by_clock`: a rank that decides to wait
for a known arrival commits its op at that arrival at once (by_clock would ask it again then, after its
neighbours moved), and when every rank waits the earliest of all forced choices runs (by_clock forces
ranks one at a time) — the orders the zero-bubble paper's variants give, pinned by the golden test.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from ..engine import Engine
from ..ir import Op
from ..order_timing import Timing
from ..placement import loop_placement
from .common import StageCosts

__all__ = ["DEFAULT_VARIANTS", "H2_POLICY", "GreedyVariant", "greedy_pass"]

_F, _B, _W = 0, 1, 2  # the engine's passes on a one-chunk rank (forward, backward), and a deferred W
_INF = math.inf
Row = list[Op]


@dataclass(frozen=True)
class GreedyVariant:
    """Policy flags of one greedy pass.

    ``w_slack``: how long (in units of the rank's ``T_W``) a filler ``W`` may delay a ``B`` or ``F``
    that arrives while it runs (0 = only in gaps it fits; ``inf`` = whenever the rank would idle).
    ``f_slack``: the same for an ``F`` that would delay an arriving ``B`` (``inf`` = run ready
    forwards at once). ``warmup``: cap ``(a, b)`` on the forwards rank ``r`` runs before its first
    backward, ``a (p - r) + b`` (``None`` = only the memory limit). ZB-H2's ``(2, -1)`` keeps the
    warm-ups of neighbours 2 apart, which the lowering pairs without posting a receive early.
    """

    name: str
    w_slack: float = 0.0
    f_slack: float = _INF
    warmup: tuple[int, int] | None = None

    @property
    def flags(self) -> tuple[float, float, tuple[int, int] | None]:
        """What a pass depends on (everything but the name)."""
        return (self.w_slack, self.f_slack, self.warmup)


DEFAULT_VARIANTS: tuple[GreedyVariant, ...] = (
    GreedyVariant("fit"),
    GreedyVariant("w-half", w_slack=0.5),
    GreedyVariant("h2-warmup", warmup=(2, -1)),
    GreedyVariant("h2-warmup-w-eager", w_slack=_INF, warmup=(2, -1)),
    GreedyVariant("1f1b-warmup", warmup=(1, 0)),
)
H2_POLICY = GreedyVariant("zb-h2")  # ZB-H2's rule: the greedy's default flags, played at unit costs


def greedy_pass(
    p: int, m: int, sc: StageCosts, limit: float, variant: GreedyVariant, w_memory: float = 1.0
) -> tuple[list[Row], Timing]:
    """One list-scheduling pass on the engine (:class:`..engine.Engine`): ranks decide in order of
    their clocks; an op starts when its rank is free and its input is there; B before F before W,
    with the variant's slack rules, never more than ``limit`` activations held.

    A rank whose choice depends on an arrival not known yet (its producer is not scheduled)
    waits until a neighbour schedules something, then decides at its own clock: timings stay
    exact because an op's start only depends on ops scheduled before it.
    Long because it is the list scheduler's one decision loop, whose branches share the ranks' clocks and queues.
    """
    eng = Engine(loop_placement(p), m, sc, w_memory=w_memory)
    room = limit - 1 + 1e-9  # an F fits while the live activations are at most this
    tf, tb, tw, c = sc.f, sc.b, sc.w, sc.comm
    clock, nxt, pending, count, total = eng.clock, eng.next, eng.pending_w, eng.count, eng.total
    run, run_w, live = eng.run, eng.run_w, eng.live
    w_slack = [variant.w_slack * x for x in tw]
    f_slack = [variant.f_slack * x for x in tf]
    if variant.warmup is None:
        cap = [m] * p
    else:
        a, b = variant.warmup
        cap = [max(1, min(m, a * (p - r) + b)) for r in range(p)]
    f_in = [eng._inputs[r][_F] for r in range(p)]  # (end times of the input, hop) per rank
    b_in: list[tuple[list[float], float]] = []
    for r in range(p):
        ends_b, hop_b = eng._inputs[r][_B]
        assert ends_b is not None  # a backward always has an input (its own F on the last stage)
        b_in.append((ends_b, hop_b))
    heap = [(0.0, r) for r in range(p)]
    queued = [True] * p
    remaining = 3 * p * m

    def decide(r: int, force: bool) -> tuple[int, float] | None:
        """``(pass or _W, start)`` of rank ``r``'s next op, or ``None`` to wait for a neighbour."""
        t = clock[r]
        i_f, i_b = nxt[r]
        # Next B: known arrival rb, or unknown with lower bound lb_b; inf when not possible yet.
        rb = lb_b = _INF
        if i_b < i_f:  # eng.arrival(r, _B), inline (the hot path)
            ends, hop = b_in[r]
            end = ends[i_b]
            if end >= 0:
                rb = end + hop
            else:
                lb_b = clock[r + 1] + tb[r + 1] + c
            if rb <= t:
                return _B, t
        # Next F, if allowed: micro-batches left, warm-up cap before the first B, memory.
        rf = lb_f = _INF
        mem_ok = live[r] <= room
        if i_f < m and (i_b > 0 or i_f < cap[r]):  # eng.arrival(r, _F), inline
            ends_f, hop = f_in[r]
            if ends_f is None:
                rf = 0.0
            else:
                end = ends_f[i_f]
                if end >= 0:
                    rf = end + hop
                else:
                    lb_f = clock[r - 1] + tf[r - 1] + c
        has_w = bool(pending[r])
        if rf <= t:
            if mem_ok:
                if t + tf[r] <= min(rb, lb_b) + f_slack[r] or force:
                    return _F, t
                if t + tf[r] <= rb + f_slack[r]:  # only an unknown B might be delayed: learn it first
                    return None
            elif has_w:
                return _W, t  # memory full: a W frees the activation the F needs
        if not mem_ok:
            rf = lb_f = _INF
        if has_w:
            known, unknown = min(rb, rf), min(lb_b, lb_f)
            end = t + tw[r]
            if end <= min(known, unknown) + w_slack[r]:
                return _W, t
            if end <= known + w_slack[r] and not force:
                return None  # only an unknown arrival might be delayed by the W: learn it first
            if force and known == _INF:
                return _W, t
        # Idle until the earliest known arrival, unless an unknown one may come first.
        if rb == _INF and rf == _INF:
            return None
        if not force and min(lb_b, lb_f) < min(rb, rf):
            return None
        return (_B, rb) if rb <= rf else (_F, rf)

    while remaining:
        if heap:
            _, r = heapq.heappop(heap)
            queued[r] = False
            choice = decide(r, False)
            if choice is None:
                continue
        else:  # every rank waits for another: the earliest known op goes first
            best: tuple[float, int, tuple[int, float]] | None = None
            for q in range(p):
                if count[q] < total:
                    option = decide(q, True)
                    if option is not None and (best is None or option[1] < best[0]):
                        best = (option[1], q, option)
            if best is None:  # pragma: no cover - impossible for limit >= 1 (see tests)
                raise AssertionError("zb-auto greedy: no rank can proceed")
            _, r, choice = best
        which, start = choice
        start = max(start, clock[r])
        if which == _W:
            run_w(r, start)
        else:
            run(r, which, start)
        remaining -= 1
        for q in (r - 1, r, r + 1):
            if 0 <= q < p and not queued[q] and count[q] < total:
                queued[q] = True
                heapq.heappush(heap, (clock[q], q))
    return eng.rows, eng.timing()
