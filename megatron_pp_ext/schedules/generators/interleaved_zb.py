"""Interleaved zero bubble: the zero-bubble B/W split (Qi et al., "Zero Bubble Pipeline Parallelism",
ICLR 2024) on Megatron's loop placement with ``v >= 2`` chunks per rank (chunk ``c`` of rank ``r`` is
stage ``c*p + r``, as in ``interleaved-1f1b``). torch.distributed.pipelining's
``ScheduleInterleavedZeroBubble`` (ZB1P) is the peer.

Each rank runs interleaved 1F1B's forward/backward order, with micro-batches in groups of ``g``
(chunk 0 for a group, then chunk 1, ...; backwards mirror it from the last chunk):

1. **warm-up**: ``(v-1) g + k (p-1-r)`` forwards on rank ``r`` (capped by the memory limit);
2. **steady state**: one forward, one input-gradient backward ``B``;
3. **cool-down**: the remaining backwards.

The weight passes ``W`` (oldest first) are placed on the list-scheduling engine (:mod:`..engine`,
the simulator's async clock), by three rules:

* before a forward, as many as the memory limit needs (a ``W`` frees its activation);
* before a backward, until at most ``lag(r)`` are pending (``r``: the paper's ZB-H1 deferral,
  which fills the cool-down; ``2r``; or no bound);
* in a wait for an input: those that end before it arrives (``fit``), or also one that delays it
  (``eager``).

:data:`POLICIES` are the combinations of ``k``, ``lag``, ``fit``/``eager`` and the group size
(``p``, or ``m`` split into ``m // p`` equal groups as ZB1P does), plus ``k = 0`` (every rank the same
warm-up); the generator times each with the given costs and keeps the fastest (makespan, then the
longest rank span, then the peak). A policy may stall (a rank waits for an input its own order makes
impossible): the engine reports it and the policy is dropped. With a tight limit, where the group
shrinks below ``p``, uneven warm-ups can do that (e.g. ``v = 5`` at 1.6 M_a); the ``k = 0`` policy
did not stall on any case tried (p <= 8, v <= 5, every limit up to ``3v + 3`` stage activations;
``tests/schedules/test_interleaved_zb.py``).

**Memory.** ``memory_limit`` is in ``M_a`` (one 1F1B stage's activation for one micro-batch; a stage
here holds ``1/v`` of a rank's layers, so ``M_a`` = ``v`` stage activations), counted from a
forward to its ``W``. Default ``p``: 1F1B's peak, what torch's ZB1P order holds, and below
``interleaved-1f1b``'s ``((v+1)p - 1)/v`` M_a, so ours is compared with both at equal or smaller
memory. Any limit ``>= 1`` works: the group shrinks to ``g <= (L-1)/(v-1)`` (``L`` the limit in
stage activations) so that a rank's first backward comes within its warm-up.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ..capabilities import Capabilities, Chunks, MemoryLimit
from ..engine import Engine, backward, forward
from ..ir import Op, OpKind
from ..order_timing import Timing, replay, span_key
from ..placement import loop_placement
from ..registry import ScheduleInfo, register
from ..schedule import Schedule, build_schedule
from .baselines import interleaved_order
from .bfs import bfs_order, fill_w
from .common import ScheduleParameterError, StageCosts, stage_costs

__all__ = [
    "INTERLEAVED_ZB",
    "POLICIES",
    "InterleavedPolicy",
    "best_order",
    "interleaved_zb",
    "interleaved_zb_order",
    "policy_orders",
    "zb_auto_looped",
]

_LAGS: dict[str, Callable[[int], float]] = {"r": lambda r: r, "2r": lambda r: 2 * r, "none": lambda r: math.inf}


@dataclass(frozen=True)
class InterleavedPolicy:
    """One variant (see the module doc): warm-up slope ``k``, ``lag`` (a key of ``_LAGS``), ``fit``,
    and ``zb1p_groups`` (``m // p`` equal groups instead of groups of ``p``)."""

    k: int
    lag: str
    fit: bool
    zb1p_groups: bool = False

    @property
    def name(self) -> str:
        groups = "-zb1p-groups" if self.zb1p_groups else ""
        return f"k{self.k}-lag-{self.lag}-{'fit' if self.fit else 'eager'}{groups}"


POLICIES: tuple[InterleavedPolicy, ...] = (
    *(
        InterleavedPolicy(k, lag, fit, zb1p)
        for zb1p in (False, True)
        for k in (1, 2)
        for lag in _LAGS
        for fit in (True, False)
    ),
    InterleavedPolicy(0, "none", False),  # the fallback: where the others stall (tight limits, see the module doc)
)


def _group(p: int, m: int, v: int, limit: int, zb1p_groups: bool) -> int:
    group = m // max(1, m // p) if zb1p_groups else min(p, m)
    return max(1, min(group, (limit - 1) // (v - 1)))


def _passes(p: int, m: int, v: int, limit: int, policy: InterleavedPolicy, r: int) -> list[int]:
    """Rank ``r``'s forward/backward passes in order (the engine's pass numbers): warm-up, steady, cool-down."""
    group = _group(p, m, v, limit, policy.zb1p_groups)
    chunks = [c for _, c in interleaved_order(m, v, group)]
    forwards = [forward(c, v) for c in chunks]
    backwards = [backward(v - 1 - c, v) for c in chunks]
    warmup = min((v - 1) * group + policy.k * (p - 1 - r), limit - 1, len(forwards))
    steady = [x for pair in zip(forwards[warmup:], backwards, strict=False) for x in pair]
    return forwards[:warmup] + steady + backwards[len(forwards) - warmup :]


def interleaved_zb_order(
    p: int, m: int, v: int, sc: StageCosts, limit: int, policy: InterleavedPolicy, w_memory: float = 1.0
) -> tuple[list[list[Op]], Timing] | None:
    """Rows and timing of one policy (``limit`` in stage activations per rank, counted with the engine's
    ``w_memory``: the share of an activation a pending ``W`` keeps); None if it stalls."""
    eng = Engine(loop_placement(p, v), m, sc, w_memory=w_memory)
    passes = [_passes(p, m, v, limit, policy, r) for r in range(p)]
    lag = [_LAGS[policy.lag](r) for r in range(p)]

    def choose(r: int) -> tuple[float, int, int | None] | None:
        clock, pending = eng.clock[r], eng.pending_w[r]
        done = sum(eng.next[r])  # forwards and backwards run so far
        if done == len(passes[r]):
            return (clock, 0, None) if pending else None  # the last W passes
        which = passes[r][done]
        w_now = (clock, 0, None) if pending else None
        if (which < v and eng.live[r] + 1 > limit + 1e-9) or (which >= v and len(pending) > lag[r]):
            return w_now  # memory full before a forward / too many W pending before a backward
        at = eng.arrival(r, which)
        if pending and (at is None or at >= clock + eng.w_duration(r) or (at > clock and not policy.fit)):
            return w_now  # the wait for the input fits a W (or, eager, any wait takes one)
        return None if at is None else (max(clock, at), 0, which)

    if not eng.earliest_first(choose):
        return None
    return eng.rows, eng.timing()


def _stage_limit(memory_limit: float | None, p: int, m: int, v: int) -> int:
    """``memory_limit`` (M_a; default ``p``) as whole stage activations, at most all of a rank's."""
    if memory_limit is None:
        return min(v * p, v * m)
    return v * m if math.isinf(memory_limit) else min(math.floor(v * memory_limit + 1e-9), v * m)


def policy_orders(
    p: int, m: int, v: int, sc: StageCosts, limit: int, w_memory: float = 1.0
) -> Iterator[tuple[str, list[list[Op]], Timing]]:
    """``(policy name, rows, timing)`` of every policy of :data:`POLICIES` that does not stall, in order;
    AssertionError if they all do."""
    built_any = False
    for policy in POLICIES:
        built = interleaved_zb_order(p, m, v, sc, limit, policy, w_memory)
        if built is not None:
            built_any = True
            yield policy.name, built[0], built[1]
    if not built_any:  # pragma: no cover - not seen: the k=0 policy has not stalled on any case tried
        raise AssertionError(f"interleaved-zb: every policy stalls at p={p}, m={m}, v={v}, limit={limit}")


def best_order(
    p: int, m: int, v: int, sc: StageCosts, limit: int
) -> tuple[tuple[float, float, float], str, list[list[Op]]]:
    """The fastest policy's ``(timing key, policy name, rows)`` (the first of equal keys)."""
    orders = policy_orders(p, m, v, sc, limit)
    key, _, name, rows = min((t.key, i, name, rows) for i, (name, rows, t) in enumerate(orders))
    return key, name, rows


def interleaved_zb(p: int, m: int, *, v: int = 2, costs: object = None, memory_limit: float | None = None) -> Schedule:
    """Interleaved zero bubble (see the module doc): the fastest of :data:`POLICIES` under ``costs``
    (per stage; unit costs by default) within ``memory_limit`` M_a per rank (default ``p``)."""
    limit = _stage_limit(memory_limit, p, m, v)
    key, name, rows = best_order(p, m, v, stage_costs(costs, p * v), limit)
    return build_schedule(
        "interleaved-zb", loop_placement(p, v), m, rows, v=v, memory_limit=limit / v, candidate=name, makespan=key[0]
    )


def zb_auto_looped(
    p: int,
    m: int,
    v: int,
    costs: object,
    memory_limit: float | None,
    *,
    objective: str = "makespan",
    w_memory: float = 1.0,
) -> Schedule:
    """``zb-auto`` with ``v >= 2`` chunks per rank on the loop placement: the search of :data:`POLICIES`
    within ``memory_limit`` stage activations per rank (zb-auto's unit: one stage's activation for one
    micro-batch; default ``2pv``, the bytes of zb-auto's ``2p`` at ``v = 1``), counted with ``w_memory``
    (the share of an activation a pending ``W`` keeps; ``B`` frees the rest), plus ``bfs-zb``'s order
    when it fits; the best under ``objective``, as for ``v = 1`` (:func:`.zero_bubble.zb_auto`): ``makespan``
    (then the longest span, then the peak) or ``span`` (the post-validated time per iteration first,
    :func:`..order_timing.span_key`)."""
    if memory_limit is None:
        limit = min(2 * p * v, v * m)
    else:
        limit = v * m if math.isinf(memory_limit) else min(int(memory_limit), v * m)
    if limit < v:
        raise ScheduleParameterError(
            f"zb-auto with v={v} needs memory_limit >= v = {v} activations (a rank holds a micro-batch's "
            f"{v} stage activations before its first backward), got {memory_limit!r}"
        )
    sc = stage_costs(costs, p * v)
    placement = loop_placement(p, v)
    candidates = list(policy_orders(p, m, v, sc, limit, w_memory))
    breadth_first = fill_w(p, bfs_order(p, m, v, m, OpKind.B), m, costs)
    timing = replay(placement, m, sc, breadth_first, w_memory=w_memory)
    if max(timing.peaks) <= limit + 1e-9:
        candidates.append(("bfs-zb", breadth_first, timing))
    span = objective == "span"
    keys = [span_key(placement, m, sc, rows, t) if span else t.key for _, rows, t in candidates]
    best = min(range(len(candidates)), key=lambda i: (keys[i], i))
    key, (name, rows, _) = keys[best], candidates[best]
    extra: dict[str, Any] = {"objective": objective, "iteration_time": key[0]} if span else {}
    if w_memory != 1.0:
        extra["w_memory"] = w_memory
    makespan = key[2] if span else key[0]
    return build_schedule(
        "zb-auto", placement, m, rows, v=v, memory_limit=limit, candidate=name, makespan=makespan, **extra
    )


INTERLEAVED_ZB = Capabilities(
    chunks=Chunks(
        low=2, high=None, default=2, refusal="{name} needs v >= 2 chunks per rank, got v={v!r}; for v=1 use zb-auto"
    ),
    memory_limit=MemoryLimit(
        "M_a",
        "1F1B-stage activations (M_a)",
        1,
        why="a rank holds a micro-batch's v stage activations (one M_a) before its first backward",
    ),
    costs=True,
)

register(
    ScheduleInfo(
        "interleaved-zb",
        interleaved_zb,
        "loop",
        True,
        "",
        "interleaved zero bubble: v chunks per rank (loop), split B/W, W passes where memory and waits allow; "
        "p M_a by default (ZB1P's)",
        family="zero-bubble",
        capabilities=INTERLEAVED_ZB,
    )
)
