"""Zero-bubble schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024).

All three split the backward into ``B`` (input gradient, on the critical path) and ``W``
(weight gradient, movable) and use the loop placement with one chunk per rank (stage ``r`` on
rank ``r``). On every rank ``F`` and ``B`` run in micro-batch order, so the lowering's FIFO
channels never move a receive.

* ``zb-h1``: 1F1B's ``F``/``B`` order; rank ``r`` defers the ``W`` of its first ``r`` steady-state
  backwards and runs them after its last backward, where 1F1B's cool-down leaves it idle.
  Peak activations equal 1F1B's (``p`` on rank 0, an activation counted live until its ``W``).
  With ``T_F = T_B = T_W`` and ``m >= p`` its idle time is ``(p-1)(T_F+T_B-T_W)``: a third of 1F1B's.
* ``zb-h2``: warm-up forwards until the first backward arrives (``2(p-r)-1`` on rank ``r``),
  backwards as soon as they arrive, ``W`` passes deferred into the free slots of the steady state
  and the tail, at most ``2p`` activations (see :func:`zb_h2_order`). With unit costs and
  ``m >= 2p - 1`` every rank is busy from its first ``F`` to its last ``W``: bubble rate 0 in the
  paper's per-rank-span definition.
* ``zb-auto``: a greedy list scheduler over the given costs (``T_F``, ``T_B``, ``T_W`` per stage
  and ``T_comm`` per hop) that never holds more than ``memory_limit`` activations on a rank. It
  tries a few policy variants (:data:`DEFAULT_VARIANTS`), plus the handcrafted schedules when they
  fit the limit, and keeps the best under its ``objective``: ``makespan`` (default: the iteration
  time with a synchronous optimizer step; then the smallest per-rank span) or ``span`` (the
  iteration time with optimizer post-validation, :func:`..timing.repeat_iterations`, which the
  longest per-rank span bounds; that objective also tries the paper's own heuristic,
  :mod:`.zb_rounds`). ``w_memory``: the fraction of an activation a pending ``W`` keeps (paper
  Table 1, ``M_W / M_B``; 1 = the whole activation until ``W``, the default).

The greedy pass and its policy flags are in :mod:`.zb_greedy` (on the list-scheduling engine: the
simulator's async clock and memory count), the paper's round-based heuristic in :mod:`.zb_rounds`, and
the reordering that keeps the lowering from posting a gradient receive early (so that every order costs
the same under the simulator's ``blocking`` and ``async`` models) in :mod:`.receive_pairing`. This module
holds the closed-form orders, the candidate search and the registrations; :func:`time_order` times a
fixed order on the engine's clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from ..capabilities import Capabilities, Chunks, MemoryLimit
from ..ir import Op, OpKind, op_grid
from ..order_timing import SPAN_ITERATIONS, Timing, replay, span_key
from ..order_timing import post_validated_time as _post_validated_time
from ..placement import loop_placement
from ..registry import ScheduleInfo, register
from ..schedule import Schedule, build_schedule
from .common import ScheduleParameterError, StageCosts, stage_costs
from .interleaved_zb import zb_auto_looped
from .receive_pairing import pair_receives
from .zb_greedy import DEFAULT_VARIANTS, H2_POLICY, GreedyVariant, greedy_pass
from .zb_rounds import ROUND_VARIANTS, rounds_order

__all__ = [
    "DEFAULT_VARIANTS",
    "GreedyVariant",
    "StageCosts",
    "Timing",
    "pair_receives",
    "stage_costs",
    "time_order",
    "zb_auto",
    "zb_h1",
    "zb_h1_order",
    "zb_h2",
    "zb_h2_order",
]

_KF, _KB, _KW = OpKind.F, OpKind.B, OpKind.W
Row = list[Op]


# ---- parameters ---------------------------------------------------------------------------------
_CHUNKS = Chunks(refusal="{name} runs one chunk per rank (loop placement, v=1): v must be 1 (or not given), got {v!r}")


def _fixed_memory(peak: str) -> Capabilities:
    return Capabilities(
        chunks=_CHUNKS,
        fixed_memory="{name} has a fixed activation memory (" + peak + ") and does not take memory_limit "
        "(got {limit!r}); use zb-auto for a memory limit",
    )


ZB_AUTO = Capabilities(
    chunks=Chunks(low=1, high=None, default=1, refusal="{name} needs v >= 1 chunks per rank, got v={v!r}"),
    memory_limit=MemoryLimit(
        "activation",
        "activations",
        2,
        why="every rank holds at least one micro-batch's activation of its stage from F to W",
    ),
    costs=True,
    keywords=("variants", "objective", "w_memory"),
)
OBJECTIVES = ("makespan", "span")


def _memory_limit(limit: float | None, p: int, m: int) -> int:
    """The limit (checked by the registry) in whole activations (default ``2p``); ``>= m`` (or
    infinity) means no limit."""
    if limit is None:
        return min(2 * p, m)
    return m if math.isinf(limit) else min(int(limit), m)


# ---- timing of a fixed order (the engine's clock: the simulator's async model) ------------------------
def time_order(rows: Sequence[Row], m: int, sc: StageCosts, w_memory: float = 1.0) -> Timing:
    """Time per-rank rows (loop placement, v=1) on the engine's clock (:func:`..order_timing.replay`)."""
    return replay(loop_placement(len(rows)), m, sc, rows, w_memory=w_memory)


def peak_activations(rows: Sequence[Row], w_memory: float = 1.0) -> float:
    """Worst rank's peak live activations of fixed rows (the engine's accounting)."""
    worst = 0.0
    for row in rows:
        live = peak = 0.0
        for op in row:
            if op.kind is _KF:
                live += 1
                if live > peak:
                    peak = live
            else:
                live -= w_memory if op.kind is _KW else 1.0 - w_memory
        worst = max(worst, peak)
    return worst


def post_validated_time(rows: Sequence[Row], m: int, sc: StageCosts, iterations: int = SPAN_ITERATIONS) -> float:
    """Time per iteration of one-chunk ``rows`` run back to back with optimizer post-validation
    (:func:`..order_timing.post_validated_time` on the loop placement)."""
    return _post_validated_time(loop_placement(len(rows)), m, sc, rows, iterations)


# ---- ZB-H1 ------------------------------------------------------------------------------------------
def zb_h1_order(p: int, m: int) -> list[Row]:
    """ZB-H1 rows: 1F1B's F/B order; rank ``r`` defers the W of its first ``r`` steady-state
    backwards to after its last backward; every other W runs right after its B."""
    f_ops, b_ops, w_ops = (op_grid(kind, p, m) for kind in (_KF, _KB, _KW))
    rows = []
    for r in range(p):
        f, b, w = f_ops[r], b_ops[r], w_ops[r]
        warmup = min(p - 1 - r, m)
        steady = m - warmup
        deferred = min(r, steady)
        row: Row = list(f[:warmup])
        for i in range(steady):
            row += [f[warmup + i], b[i]]
            if i >= deferred:
                row.append(w[i])
        for i in range(steady, m):
            row += [b[i], w[i]]
        row += w[:deferred]
        rows.append(row)
    return rows


# ---- ZB-H2 ------------------------------------------------------------------------------------------
def zb_h2_order(p: int, m: int, greedy: Callable[..., tuple[list[Row], Timing]] | None = None) -> list[Row]:
    """ZB-H2 rows: the rule below played once with ``T_F = T_B = T_W = 1`` and free communication
    (the order is then fixed, whatever the real costs), then :func:`pair_receives`.

    Every rank runs a backward as soon as its input gradient is there; otherwise a forward when
    one is ready and it holds fewer than ``2p`` activations; otherwise a deferred ``W``, but only
    where it ends before the next backward or forward arrives. This gives rank ``r`` the
    ``2(p-r)-1`` warm-up forwards of the paper, a steady state of ``B``/``F`` with a ``W`` in every
    free slot once ``2p`` activations are held, and a tail in which the backwards run back to back
    with the deferred ``W`` passes between and after them: the parallelogram layout, with every
    rank busy from its first ``F`` to its last ``W`` once ``m >= 2p``.
    """
    run = greedy_pass if greedy is None else greedy  # zb-auto passes its memo of greedy passes
    return pair_receives(run(p, m, stage_costs(None, p), min(2 * p, m), H2_POLICY)[0])


# ---- generators ---------------------------------------------------------------------------------------
def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (see :func:`zb_h1_order`): 1F1B's memory, about a third of its bubble."""
    return build_schedule("zb-h1", loop_placement(p), m, zb_h1_order(p, m))


def zb_h2(p: int, m: int) -> Schedule:
    """ZB-H2 (see :func:`zb_h2_order`): about zero bubble with at most ``2p`` activations."""
    return build_schedule("zb-h2", loop_placement(p), m, zb_h2_order(p, m))


def zb_auto(
    p: int,
    m: int,
    *,
    costs: object = None,
    memory_limit: float | None = None,
    variants: Sequence[GreedyVariant] | None = None,
    objective: str | None = None,
    w_memory: float | None = None,
    v: int = 1,
) -> Schedule:
    """Cost-aware zero-bubble schedule under an activation memory limit.

    ``costs``: any object with ``t_f``, ``t_b``, ``t_w`` (a number or one per stage) and ``t_comm``
    (default unit costs, no communication cost). ``memory_limit``: activations a rank may hold at
    once, in units of one stage's activation for one micro-batch (default ``2p``; ``>= 1``).
    ``variants``: the greedy policies to try (default :data:`DEFAULT_VARIANTS`). ``objective``:
    ``makespan`` (default) or ``span`` (module doc). ``w_memory`` (``0 < f <= 1``, default 1): the
    share of an activation a pending ``W`` keeps; ``B`` frees the rest (the limit counts so).

    The result's ``params`` record the winning candidate (``candidate``) and its predicted
    ``makespan`` (and, when not the defaults, ``objective``, ``w_memory`` and the predicted
    ``iteration_time`` with post-validation). ``v >= 2``: loop placement with ``v`` chunks per rank, searched by
    :func:`.interleaved_zb.zb_auto_looped` with the same ``objective`` and ``w_memory`` (``variants`` are the
    one-chunk greedy's: not taken there).
    Long because its docstring documents every option of the search; the body resolves them and tries the variants.
    """
    objective = "makespan" if objective is None else objective
    if objective not in OBJECTIVES:
        raise ScheduleParameterError(f"objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    w = 1.0 if w_memory is None else check_w_memory(w_memory)
    if v > 1:
        if variants is not None:
            raise ScheduleParameterError(f"zb-auto takes variants only with v=1 (one chunk per rank), got v={v}")
        return zb_auto_looped(p, m, v, costs, memory_limit, objective=objective, w_memory=w)
    limit = _memory_limit(memory_limit, p, m)
    sc = stage_costs(costs, p)
    tried = DEFAULT_VARIANTS if variants is None else tuple(variants)
    if not tried:
        raise ScheduleParameterError("variants must list at least one GreedyVariant")
    span = objective == "span"
    placement = loop_placement(p)
    candidates: list[tuple[tuple[float, ...], int, str, list[Row]]] = []

    def add(name: str, rows: list[Row], timing: Timing) -> None:
        key: tuple[float, ...] = timing.key
        if span:
            key = span_key(placement, m, sc, rows, timing)
        candidates.append((key, len(candidates), name, rows))

    done: dict[tuple[object, ...], tuple[list[Row], Timing]] = {}

    def greedy(
        p: int, m: int, costs: StageCosts, lim: float, policy: GreedyVariant, w_mem: float = 1.0
    ) -> tuple[list[Row], Timing]:
        """:func:`.zb_greedy.greedy_pass`, each pass once: at unit costs ZB-H2's pass is the "fit" variant's."""
        key = (costs, lim, policy.flags, w_mem)
        if key not in done:
            done[key] = greedy_pass(p, m, costs, lim, policy, w_mem)
        return done[key]

    for handcrafted, order in (("zb-h1", zb_h1_order), ("zb-h2", lambda p, m: zb_h2_order(p, m, greedy))):
        if handcrafted == "zb-h2" and min(2 * p - 1, m) > limit:
            continue  # its rank 0 runs 2p-1 warm-up forwards before any backward: it cannot fit
        rows = order(p, m)
        if peak_activations(rows, w) <= limit + 1e-9:  # a fixed order's memory needs no timing
            add(handcrafted, rows, time_order(rows, m, sc, w))
    passes = [(v.name, lambda v=v: greedy(p, m, sc, limit, v, w)) for v in tried]
    if span:
        passes += [(v.name, lambda v=v: rounds_order(p, m, sc, limit, v, w)) for v in ROUND_VARIANTS]
    for name, run in passes:
        try:
            rows, timing = run()
        except ValueError:  # a round-based pass that cannot fit the limit
            continue
        paired = pair_receives(rows)
        if paired != rows:
            if span:  # the async clock (the executor's) does not need the pairing: keep both
                add(name, rows, timing)
            rows, timing = paired, time_order(paired, m, sc, w)
        add(name, rows, timing)
    key, _, name, rows = min(candidates)
    extra: dict[str, Any] = {}
    if span:
        extra = {"objective": objective, "iteration_time": key[0]}
    if w != 1.0:
        extra["w_memory"] = w
    makespan = key[2] if span else key[0]
    return build_schedule("zb-auto", placement, m, rows, memory_limit=limit, candidate=name, makespan=makespan, **extra)


def check_w_memory(value: object) -> float:
    """``w_memory`` as a float in ``(0, 1]``, or :class:`ScheduleParameterError`."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0.0 < value <= 1.0:
        raise ScheduleParameterError(
            f"w_memory (share of an activation a pending W keeps) must be in (0, 1], got {value!r}"
        )
    return float(value)


register(
    ScheduleInfo(
        "zb-h1",
        zb_h1,
        "loop",
        True,
        "",
        "zero bubble H1: 1F1B order, deferred W passes fill the cool-down; 1F1B's memory",
        family="zero-bubble",
        capabilities=_fixed_memory("p activations, like 1F1B"),
    )
)
register(
    ScheduleInfo(
        "zb-h2",
        zb_h2,
        "loop",
        True,
        "zero bubble for m >= 2p-1",
        "zero bubble H2: 2(p-r)-1 warm-up forwards, deferred W passes fill the tail; up to 2p activations",
        family="zero-bubble",
        capabilities=_fixed_memory("up to 2p activations"),
    )
)
register(
    ScheduleInfo(
        "zb-auto",
        zb_auto,
        "loop",
        True,
        "",
        "zero bubble auto: greedy over F/B/W costs and comm under a memory limit (ZB-1p with p, ZB-2p with 2p)",
        family="zero-bubble",
        capabilities=ZB_AUTO,
    )
)
