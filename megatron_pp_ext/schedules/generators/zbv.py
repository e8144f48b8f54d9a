"""V-ZB: the zero-bubble paper's ZB-V (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024)
on the V placement (see :mod:`.vshape`), within a memory limit.

``v-zb`` runs ZB-V on the V placement, never holding more than ``memory_limit`` (in ``M_a``;
default ``p``, 1F1B's peak) on a rank. It times the passes with the given costs (``t_f``,
``t_b``, ``t_w``: a number or one per stage; ``t_comm`` per hop; read from any object that has
them, e.g. ``schedules.costs.Costs``; unit costs by default) and tries the schedules of
:data:`POLICIES`, keeping the one that runs fastest as the executor runs it (the simulator's
async model, in which the lowering's batched exchanges make no rank wait beyond its own inputs;
the ``ordered`` greedy policies also keep messages in one order for the blocking model).
First, ZB-V built round by round as the
zero-bubble authors' generator builds it (:mod:`.zbv_rounds`): a fixed warm-up of forwards, then
rounds of one backward and one forward per rank with deferred ``W`` passes where the memory
needs them or a wait leaves room, rebuilt with each rank's idle time from the previous build as
its allowance while that helps. With the default limit it is exactly zero bubble at
``T_F = T_B = T_W`` once ``m >= 2p - 1`` (checked for p = 2..32) with peak exactly ``p`` M_a,
and the search stops there, as nothing can end sooner. Otherwise it also tries a greedy list
scheduler (:mod:`.zbv_greedy`) and the paper's handcrafted ZB-V as fixed-priority list schedules
(:func:`handcrafted`). ``params["ideal_bubble_rate"]`` is the bubble when every pass
starts as soon as its input exists, ``params["predicted_bubble_rate"]`` the one the lowered
program gives (what the simulator and the runtime see).

The constructions run on the list-scheduling engine (:mod:`..engine`: op encoding, the simulator's
async clock, memory); this module keeps their decisions, and times every candidate with the engine's
:func:`~..order_timing.replay` (tests cross-check it against ``analysis.simulate``).
"""

from __future__ import annotations

import math

from ..capabilities import MemoryLimit, check_request
from ..engine import Engine
from ..ir import Op
from ..order_timing import Timing, replay
from ..placement import v_placement
from ..registry import ScheduleInfo, register
from ..schedule import Schedule, build_schedule
from .common import StageCosts, check_int, stage_costs
from .vshape import v_capabilities
from .zbv_greedy import PB, PF, Greedy, Pb, Pf, Policy
from .zbv_rounds import build_rounds

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


#: Variants v-zb tries; it keeps the one whose lowered program runs fastest, and stops early once
#: one cannot be beaten (see :func:`v_zb_order`), so the round-built ZB-V comes first. (Preferring
#: the chunk-1 backward never won on a grid of p, m, costs and limits, so it is not tried.)
POLICIES = (
    tuple(Policy(False, False, True, rounds=fill) for fill in ("F B", "F", "B", "-"))
    + tuple(Policy(ordered, lazy, True) for ordered in (False, True) for lazy in (False, True))
    + tuple(Policy(False, False, True, h) for h in ("B0 F0 F1 B1 W +cap", "F0 F1 B0 B1 W +cap", "B0 B1 F1 W F0"))
)


def handcrafted(p: int, m: int, sc: StageCosts, limit: int, spec: str) -> tuple[list[list[Op]], VZBTiming] | None:
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
    passes = {"F0": PF, "F1": Pf, "B0": Pb, "B1": PB, "W": None}
    order = [passes[n] for n in names if n != "+cap"]
    eng = Engine(v_placement(p), m, sc)
    nxt, live, clock, pending = eng.next, eng.live, eng.clock, eng.pending_w

    def arrival(r: int, which: int) -> float | None:
        """When rank r's next ``which`` pass could start by its input, if the policy allows it now."""
        n = nxt[r]
        if which == PF:  # admit a micro-batch: room for its chunk-1 forward, and the warm-up cap
            if live[r] + 2 > limit or (cap and n[PF] - n[Pf] >= max(1, 2 * p - 1 - 2 * r)):
                return None
        elif which == Pf:
            if n[Pf] >= n[PF] or live[r] + 1 > limit:
                return None
        elif n[which] >= n[Pf if which == PB else PB]:  # B1 after F1, B0 after B1
            return None
        return eng.arrival(r, which)

    def choose(r: int) -> tuple[float, int, int | None] | None:
        """Rank r's next pass: (start, priority, pass or None for W): the earliest start, then the priority."""
        if eng.done(r):
            return None
        cands: list[tuple[float, int, int | None]] = []
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


def _candidate(p: int, m: int, sc: StageCosts, limit: int, policy: Policy) -> tuple[list[list[Op]], VZBTiming] | None:
    """One policy's per-rank orders and ideal timing, or None if it stalls."""
    if policy.rounds:
        return build_rounds(p, m, sc, limit, policy)
    if policy.handcrafted:
        return handcrafted(p, m, sc, limit, policy.handcrafted)
    greedy = Greedy(p, m, sc, limit, policy)
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
        timing = replay(placement, m, sc, rows)  # the simulator's async model: as the lowered program runs
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
