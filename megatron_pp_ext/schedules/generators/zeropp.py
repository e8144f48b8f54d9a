"""ZeroPP: blockwise task-interleaved pipeline with scheduling units (Tang et al., "Adaptive Blockwise
Task-interleaved Pipeline Parallelism", 2024). No public implementation exists; this design is ours
(docs/zeropp.md).

Loop placement: ``v`` chunks per rank, chunk ``c`` of rank ``r`` is stage ``c*p + r``. The ``m``
micro-batches are cut into **scheduling units** of ``U`` (``unit_size``); when ``U`` does not divide
``m`` the last unit holds the remainder ``m % U``. Rank ``r`` works through three queues:

1. *blockwise forwards*: unit by unit, the unit's micro-batches through chunk 0, then chunk 1, ...,
   chunk ``v-1`` (breadth-first over the rank's stages inside the unit);
2. *blockwise input-gradient backwards* ``B``: unit by unit, chunk ``v-1`` down to chunk 0;
3. *staggered weight-gradient backwards* ``W``: every ``B`` queues its ``W``.

Task interleaving, decided on a timed model of the run (``costs``, default unit costs, like the
simulator): whenever the rank is free it runs a ``B`` whose input is there, else an ``F`` whose input
is there (each from the earliest open unit first), else a queued ``W`` if one fits whole before the next
``F``/``B`` can start; ``W`` passes also run when nothing else is left. So consecutive units overlap:
unit ``k+1``'s forwards fill the gaps of unit ``k``'s backwards, and ``W`` of other micro-batches fill what
is left. Inside a unit the order stays blockwise. A window bounds memory: with ``w = ceil(p / U)``
(enough units to keep ``p`` micro-batches in flight), the tasks of unit ``k + w + 1`` wait until the rank
has run every ``B`` of unit ``k``, and the ``W`` passes of unit ``k`` run before the first ``B`` of unit
``k + w + 1``. ``memory_limit`` (in ``M_a``) caps the live activations (F to W) further: a micro-batch
reserves its ``v`` activations at its first forward on the rank (only if every not-yet-started
micro-batch of an earlier unit still fits too), queued ``W`` passes run first when memory is short.

FSDP (``fsdp_max_unsharded`` = :data:`FSDP_MAX_UNSHARDED`, declared in ``Schedule.params``): one chunk
gathered for the newest unit's forward sweep and one for the oldest unit's backward sweep. Gathers per
rank per iteration: ``v`` when ``v <= 2`` (every chunk stays gathered), ``2v - 2`` for ``U = m``, at most
``2v`` per unit otherwise (overlapping units share gathered chunks, so small units pay less).
Gradients (``fsdp_grad_reduce_unit`` = U, declared too): each chunk is reduce-scattered right after its last
gradient op of every unit, ``v ceil(m/U)`` reductions per rank per iteration, so a chunk's full-size gradient
buffer lives from a unit's first gradient op to that unit's reduction, not for the whole iteration.
``U`` trades: a larger unit means fewer gathers and a shorter fill, at more memory (about ``p + U``
micro-batches in flight plus the activations pending ``W`` keep); ``U = 1`` is a depth-first order with
the most gathers, ``U = m`` one blockwise unit (one sweep per chunk and direction).
"""

from __future__ import annotations

import math
from collections import deque

from ..capabilities import Capabilities, Chunks, DataParallel, MemoryLimit
from ..ir import B, F, Op, OpKind, W
from ..placement import loop_placement
from ..registry import ScheduleInfo, register
from ..schedule import Schedule, build_schedule
from .common import ScheduleParameterError, check_int, reject_unsupported, stage_costs

__all__ = ["FSDP_MAX_UNSHARDED", "unit_ranges", "zeropp", "zeropp_order"]

#: Gathered chunks a rank may hold under FSDP: the forward sweep's and the backward sweep's.
FSDP_MAX_UNSHARDED = 2


def unit_ranges(m: int, unit: int) -> list[range]:
    """The scheduling units: ``[0, U), [U, 2U), ...``; the last holds the remainder."""
    return [range(start, min(start + unit, m)) for start in range(0, m, unit)]


def zeropp_order(
    p: int, m: int, v: int, unit: int, costs: object = None, memory_limit: float | None = None
) -> list[list[Op]]:
    """Per rank, the interleaved order of the module doc (a list scheduler over the three queues);
    ``memory_limit``: live activations per rank in ``M_a`` (``v`` looped-stage activations), F to W.
    Long because it is one list-scheduling loop over the three queues, its rules in the module doc's order.
    """
    units = unit_ranges(m, unit)
    unit_of = [k for k, mbs in enumerate(units) for _ in mbs]
    last = v * p - 1
    sc = stage_costs(costs, v * p)
    # per rank and unit: the unit's forwards blockwise (chunk 0 first), its backwards (chunk v-1 first)
    forwards = [[deque(F(c * p + r, i) for c in range(v) for i in mbs) for mbs in units] for r in range(p)]
    backwards = [[deque(B(c * p + r, i) for c in reversed(range(v)) for i in mbs) for mbs in units] for r in range(p)]
    waiting: list[deque[Op]] = [deque() for _ in range(p)]  # W passes queued by each B
    end: dict[Op, float] = {}
    clock = [0.0] * p
    out: list[list[Op]] = [[] for _ in range(p)]
    cap = None if memory_limit is None else memory_limit * v + 1e-9  # in looped-stage activations
    reserved = [0] * p  # a micro-batch reserves its v activations at its first forward on the rank, W frees one
    window = -(-p // unit)  # units whose forwards may run ahead of the backwards' unit: >= p micro-batches
    idle_steps = 0

    def producer(op: Op) -> Op | None:
        if op.kind == OpKind.F:
            return F(op.stage - 1, op.microbatch) if op.stage > 0 else None
        return F(op.stage, op.microbatch) if op.stage == last else B(op.stage + 1, op.microbatch)

    def ready(op: Op, rank: int) -> float:
        """When ``op``'s input arrives; for a producer not yet run, a lower bound."""
        prev = producer(op)
        if prev is None:
            return 0.0
        hop = 0.0 if prev.stage % p == rank else sc.comm
        if prev in end:
            return end[prev] + hop
        cost = (sc.f if prev.kind == OpKind.F else sc.b)[prev.stage]
        return clock[prev.stage % p] + cost + hop + 1e-9  # it cannot start before its rank is free

    # queues are only ever popped, so each rank's earliest unit with backwards (forwards) left only moves on:
    # kept per rank, it spares rescanning the emptied units at every step (O(m / U) each)
    b_first = [0] * p
    f_first = [0] * p

    def b_unit(r: int) -> int:  # the earliest unit with backwards left on rank r
        k, queues = b_first[r], backwards[r]
        while k < len(queues) and not queues[k]:
            k += 1
        b_first[r] = k
        return k

    def f_unit(r: int) -> int:  # the earliest unit with forwards left on rank r
        k, queues = f_first[r], forwards[r]
        while k < len(queues) and not queues[k]:
            k += 1
        f_first[r] = k
        return k

    def candidates(r: int) -> list[deque[Op]]:
        """The queues whose front may run next, in priority order: backwards, then forwards, each of the
        open units earliest first (a later unit's task fills a gap of an earlier one)."""
        k = b_unit(r)
        fronts = [q for q in backwards[r][k : k + window + 1] if q]
        # a started micro-batch always runs on; a new one needs room for itself and for every micro-batch of
        # an earlier unit not started yet (a later unit never takes the memory an earlier one needs)
        before = 0
        for q in forwards[r][min(f_unit(r), k + window + 1) : k + window + 1]:  # emptied units count nothing
            if q and (q[0].stage >= p or cap is None or reserved[r] + v * (before + 1) <= cap):
                fronts.append(q)
            if cap is not None:
                before += sum(1 for op in q if op.stage < p)
        return fronts

    def out_of_memory(r: int) -> bool:
        return cap is not None and reserved[r] + v > cap

    def w_overdue(r: int) -> bool:  # W of unit k run before the first B of unit k + window + 1
        return bool(waiting[r] and unit_of[waiting[r][0].microbatch] + window < b_unit(r))

    def run(r: int, op: Op, start: float) -> None:
        nonlocal idle_steps
        idle_steps = 0
        duration = {OpKind.F: sc.f, OpKind.B: sc.b, OpKind.W: sc.w}[op.kind][op.stage]
        clock[r] = end[op] = start + duration
        out[r].append(op)
        left[r] -= 1
        if op.kind == OpKind.F and op.stage < p:
            reserved[r] += v
        elif op.kind == OpKind.W:
            reserved[r] -= 1

    left = [3 * v * m] * p  # ops each rank has still to run

    while any(left):
        # the rank that is free first decides: everything that can be ready by then is known
        r = min((q for q in range(p) if left[q]), key=lambda q: (clock[q], q))
        now = clock[r]
        fronts = candidates(r)
        if waiting[r] and (w_overdue(r) or not fronts or out_of_memory(r)):
            run(r, waiting[r].popleft(), now)
            continue
        times: list[float] = []
        first = None
        for q in fronts:  # the first one whose input is there, in priority order
            times.append(ready(q[0], r))
            if times[-1] <= now:
                first = q
                break
        if first is not None:  # a B before an F, an earlier unit's F before a later one's
            op = first.popleft()
            run(r, op, now)
            if op.kind == OpKind.B:
                waiting[r].append(W(op.stage, op.microbatch))
            continue
        if not fronts:  # pragma: no cover - memory-blocked with nothing to free: memory_limit >= 1 prevents it
            raise ScheduleParameterError(f"zeropp: rank {r} is out of activation memory (memory_limit)")
        soonest = min(times)
        if waiting[r] and now + sc.w[waiting[r][0].stage] <= soonest:  # a W fits in the gap
            run(r, waiting[r].popleft(), now)
            continue
        idle_steps += 1
        if idle_steps > 100 * p + 1000:  # pragma: no cover - the queues' orders are deadlock-free
            raise ScheduleParameterError(f"zeropp: rank {r} waits forever for {[q[0] for q in fronts]}")
        later = [clock[q] for q in range(p) if clock[q] > now]
        clock[r] = min([soonest, *later])  # idle until an input may have arrived
    return out


_LIMIT_FLAGS = "--memory-limit; --pipeline-memory-limit under megatron"


def _check(p: int, m: int, v: int | None, unit_size: object) -> tuple[int, int]:
    check_int("p", p, 1)
    check_int("m", m, 1)
    if v is None:
        v = 2
    elif isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ScheduleParameterError(f"zeropp: v (chunks per rank, -v) must be an integer >= 1, got {v!r}")
    unit = m if unit_size is None else unit_size
    if isinstance(unit, bool) or not isinstance(unit, int) or not 1 <= unit <= m:
        raise ScheduleParameterError(
            f"zeropp: unit_size (--pipeline-unit-size, micro-batches per scheduling unit) must be an integer in "
            f"1..m = 1..{m} or 'auto', got {unit!r}"
        )
    return v, unit


def zeropp(
    p: int,
    m: int,
    *,
    v: int | None = None,
    unit_size: int | str | None = None,
    costs: object = None,
    memory_limit: float | None = None,
    **unused: object,
) -> Schedule:
    """ZeroPP with ``v`` chunks per rank (default 2) and scheduling units of ``unit_size`` micro-batches
    (default ``m``, or the largest that ``memory_limit`` holds). ``"auto"`` needs the simulator, which
    sits above this package: ``registry.generate`` hands it to the chooser that
    :mod:`megatron_pp_ext.analysis.zeropp_auto` registers, which calls this generator with a number.
    ``memory_limit``: live activations per rank in ``M_a`` (>= 1): a forward waits until it fits (running
    queued ``W`` passes first)."""
    reject_unsupported("zeropp", unused)
    if isinstance(unit_size, str) and unit_size.strip().lower() == "auto":
        raise ScheduleParameterError(
            "zeropp: unit_size 'auto' is chosen with the simulator, which registers the choice with the "
            "registry when megatron_pp_ext.analysis is imported (import it before registry.generate)"
        )
    if isinstance(unit_size, str) and unit_size.strip().isdigit():
        unit_size = int(unit_size)
    if memory_limit is not None and (
        isinstance(memory_limit, bool) or not isinstance(memory_limit, int | float) or not memory_limit >= 1
    ):
        raise ScheduleParameterError(
            f"zeropp: memory_limit ({_LIMIT_FLAGS}, live activations per rank in M_a = one 1F1B stage's "
            f"activation) must be a number >= 1, got {memory_limit!r}"
        )
    if unit_size is None and memory_limit is not None and isinstance(m, int):
        unit_size = max(1, min(m, int(memory_limit)))  # the largest unit the limit holds
    v, unit = _check(p, m, v, unit_size)
    if memory_limit is not None and memory_limit < unit:
        raise ScheduleParameterError(
            f"zeropp: a unit of unit_size={unit} micro-batches runs each chunk for all of them before the next chunk, "
            f"so it needs memory_limit >= unit_size M_a; got memory_limit ({_LIMIT_FLAGS}) {memory_limit:g}: "
            f"use --pipeline-unit-size <= {int(memory_limit)} or 'auto'"
        )
    return build_schedule(
        "zeropp",
        loop_placement(p, v),
        m,
        zeropp_order(p, m, v, unit, costs, memory_limit),
        v=v,
        unit_size=unit,
        memory_limit=memory_limit,
        fsdp_max_unsharded=min(FSDP_MAX_UNSHARDED, v),
        fsdp_grad_reduce_unit=unit,  # FSDP: reduce-scatter each chunk's gradients once per unit
    )


register(
    ScheduleInfo(
        "zeropp",
        zeropp,
        "loop",
        True,
        "p >= 1, m >= 1, v >= 1 (default 2), 1 <= unit_size <= m or 'auto' (default m; a last unit of m % U)",
        "ZeroPP blockwise: units of U micro-batches breadth-first over the rank's chunks, consecutive units "
        "overlapped, staggered W; FSDP gathers about twice per chunk per unit",
        family="blockwise",
        capabilities=Capabilities(
            chunks=Chunks(low=1, high=None, default=2, refusal="{name} needs v >= 1 chunks per rank, got v={v!r}"),
            memory_limit=MemoryLimit(
                unit="M_a",
                units="1F1B stage activations per rank",
                default_per_rank=math.inf,
                minimum=1.0,
                why="a forward waits until its activation fits; a unit of U needs at least U",
            ),
            costs=True,
            keywords=("unit_size",),
            data_parallel=DataParallel(fsdp="optional"),
        ),
    )
)
