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

The greedy passes run on the list-scheduling engine (:mod:`..engine`): its clock is the simulator's
async model and its memory count the simulator's default (an ``F`` adds one activation on its rank,
the matching ``W`` frees it; ``B`` frees nothing); this module keeps only the decisions. Under the
simulator's ``comm="blocking"`` model a gradient receive that the lowering posts early (to keep
rendezvous sends free of deadlock) would make its rank wait: :func:`pair_receives` reorders forwards
so that this never happens, so the orders cost the same under both models. :func:`time_order`
times a fixed order on the engine's clock.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..capabilities import Capabilities, Chunks, MemoryLimit
from ..engine import SPAN_ITERATIONS, Engine, Timing, replay, span_key
from ..engine import post_validated_time as _post_validated_time
from ..ir import Op, OpKind, op_grid
from ..placement import loop_placement
from ..registry import ScheduleInfo, register
from ..schedule import Schedule, build_schedule
from .common import ScheduleParameterError, StageCosts, stage_costs
from .interleaved_zb import zb_auto_looped
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
_F, _B, _W = 0, 1, 2  # the engine's passes on a one-chunk rank (forward, backward), and a deferred W
_INF = math.inf
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
    """Time per-rank rows (loop placement, v=1) on the engine's clock (:func:`..engine.replay`)."""
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
    (:func:`..engine.post_validated_time` on the loop placement)."""
    return _post_validated_time(loop_placement(len(rows)), m, sc, rows, iterations)


def pair_receives(rows: Sequence[Row]) -> list[Row]:
    """Delay forwards so that the lowering never has to post a gradient receive early.

    Between ranks ``r`` and ``r+1`` the lowering sends ``act(i)`` after ``F_r(i)``, receives it
    before ``F_{r+1}(i)``, sends ``grad(j)`` after ``B_{r+1}(j)`` and receives it before ``B_r(j)``;
    messages in adjacent gaps share one exchange. If rank ``r`` sends ``act(i)`` before it
    receives ``grad(j)`` while rank ``r+1`` sends ``grad(j)`` before it receives ``act(i)`` (in
    different exchanges on both sides), rendezvous sends would deadlock, so the lowering moves
    the receive of ``grad(j)`` up to ``F_r(i)`` and rank ``r`` waits there. With ``T`` the
    forwards rank ``r+1`` runs before ``B_{r+1}(j)`` this cannot happen while rank ``r`` runs at
    most ``T`` forwards before ``B_r(j)``, one more when ``F_{r+1}(T)`` directly follows
    ``B_{r+1}(j)``, and one more when ``B_r(j)`` directly follows its last forward. Rank by rank
    from the last, a forward beyond that moves to just after the next backward; forwards only
    move later, so dependencies and the peak memory of every rank still hold.
    """
    out = [list(row) for row in rows]
    m = sum(1 for op in out[0] if op.kind is _KB)
    for r in range(len(rows) - 2, -1, -1):
        out[r] = _delay_forwards(out[r], _forward_limits(out[r + 1], m))
    return out


def _forward_limits(down: Row, m: int) -> tuple[list[int], list[int]]:
    """From the downstream rank's row: ``limit[j]``, the forwards the upstream rank may run before
    ``B(j)`` if ``B(j)`` directly follows its last one, plus one (``T + 1`` if ``F(T)`` directly
    follows ``B_{r+1}(j)``, else ``T``); and ``later[j] = min(limit[j:])``."""
    limit = [0] * m
    count = 0
    last = len(down) - 1
    for k, op in enumerate(down):
        if op.kind is _KF:
            count += 1
        elif op.kind is _KB:
            limit[op.microbatch] = count + 1 if k < last and down[k + 1].kind is _KF else count
    later = limit[:]
    for j in range(m - 2, -1, -1):
        if later[j + 1] < later[j]:
            later[j] = later[j + 1]
    return limit, later


def _delay_forwards(row: Row, limits: tuple[list[int], list[int]]) -> Row:
    limit, later = limits
    m = len(limit)
    later.append(m + 1)  # sentinel: no constraint after the last backward
    limit.append(m + 1)

    def allowed(i: int, next_is_b: bool, j: int) -> bool:
        return i < later[j + 1] and (i < limit[j] or (next_is_b and i <= limit[j])) if j < m else True

    new: Row = []
    postponed: list[Op] = []  # forwards held back, in order
    j = 0  # the rank's next backward
    last = len(row) - 1
    for k, op in enumerate(row):
        kind, i = op.kind, op.microbatch
        if kind is _KF:
            if postponed or not (
                i < later[j + 1] and (i < limit[j] or (i == limit[j] and k < last and row[k + 1].kind is _KB))
            ):
                postponed.append(op)
            else:
                new.append(op)
        elif kind is _KB:
            if postponed:
                while postponed and allowed(postponed[0].microbatch, len(postponed) == 1, j):
                    new.append(postponed.pop(0))
            new.append(op)
            j = i + 1
            while postponed and allowed(postponed[0].microbatch, False, j):
                new.append(postponed.pop(0))
        else:
            new.append(op)
    return new + postponed


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
    run = _greedy if greedy is None else greedy  # zb-auto passes its memo of greedy passes
    return pair_receives(run(p, m, stage_costs(None, p), min(2 * p, m), _H2_POLICY)[0])


# ---- ZB-auto: greedy list scheduler ------------------------------------------------------------------
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


DEFAULT_VARIANTS: tuple[GreedyVariant, ...] = (
    GreedyVariant("fit"),
    GreedyVariant("w-half", w_slack=0.5),
    GreedyVariant("h2-warmup", warmup=(2, -1)),
    GreedyVariant("h2-warmup-w-eager", w_slack=_INF, warmup=(2, -1)),
    GreedyVariant("1f1b-warmup", warmup=(1, 0)),
)
_H2_POLICY = GreedyVariant("zb-h2")  # ZB-H2's rule: the greedy's default flags, played at unit costs


def _greedy(
    p: int, m: int, sc: StageCosts, limit: float, variant: GreedyVariant, w_memory: float = 1.0
) -> tuple[list[Row], Timing]:
    """One list-scheduling pass on the engine (:class:`..engine.Engine`): ranks decide in order of
    their clocks; an op starts when its rank is free and its input is there; B before F before W,
    with the variant's slack rules, never more than ``limit`` activations held.

    A rank whose choice depends on an arrival not known yet (its producer is not scheduled)
    waits until a neighbour schedules something, then decides at its own clock: timings stay
    exact because an op's start only depends on ops scheduled before it.
    """
    eng = Engine(loop_placement(p), m, sc, w_memory=w_memory)
    room = limit - 1 + 1e-9  # an F fits while the live activations are at most this
    tf, tb, tw, c = sc.f, sc.b, sc.w, sc.comm
    clock, nxt, count, total = eng.clock, eng.next, eng.count, eng.total
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
        has_w = 2 * i_b + i_f > count[r]  # W passes pending: backwards run minus W passes run
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
        """:func:`_greedy`, each pass once: at unit costs ZB-H2's pass is the "fit" variant's."""
        key = (costs, lim, policy.w_slack, policy.f_slack, policy.warmup, w_mem)
        if key not in done:
            done[key] = _greedy(p, m, costs, lim, policy, w_mem)
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
    extra: dict[str, object] = {}
    if span:
        extra = {"objective": objective, "iteration_time": key[0]}
    if w != 1.0:
        extra["w_memory"] = w
    makespan = key[2] if span else key[0]
    return build_schedule(
        "zb-auto", loop_placement(p), m, rows, memory_limit=limit, candidate=name, makespan=makespan, **extra
    )


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
