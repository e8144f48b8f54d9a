"""Breadth-first looped pipeline (Lamy-Poirier, "Breadth-First Pipeline Parallelism", MLSys 2023).

Loop placement: ``v`` chunks per rank, chunk ``c`` of rank ``r`` is stage ``c*p + r`` (as Megatron's
interleaved 1F1B). The paper's breadth-first order, rank ``r``:

1. *forward sweeps*: all micro-batches through chunk 0 (stage ``r``), then all through chunk 1
   (stage ``p + r``), ..., chunk ``v-1``;
2. *backward sweeps*, in reverse: all micro-batches through chunk ``v-1``, ..., chunk 0.

A chunk's last backward comes early in the backward pass (chunk ``v-1`` after the first ``m``
backwards), so its gradient reduction overlaps the rest of the backward work, and under FSDP a
chunk's weights are gathered once per sweep: with one gathered chunk at a time
(:data:`FSDP_MAX_UNSHARDED`, declared in ``Schedule.params``) twice per iteration per chunk.
With unit costs, ``m >= p`` and no communication cost the bubble is ``(p-1)/(v m + p-1)``; every
micro-batch is alive at the turn: ``v m`` stage activations = ``m`` 1F1B activations per rank.

Hybrid (Fast-LLM's breadth-first / depth-first micro-batch split): ``microbatch_group_size = g``
splits the micro-batches into groups of ``g`` (the last one takes the remainder) run one after
another, each group breadth-first as above; ``g = m`` (default) is pure breadth-first. Memory falls
to ``g`` 1F1B activations; every group pays its own pipeline fill and drain, and FSDP gathers
twice per chunk per group. (Megatron's ``interleaved-1f1b`` with the same ``microbatch_group_size``
runs the same forward and backward orders but overlaps the groups in a 1F1B steady state, see
``tests/schedules/test_bfs.py``.)

``bfs-zb`` splits every backward into ``B`` and ``W``: the ``F``/``B`` order stays, and each
``W`` waits on its rank until an idle slot fits it (the cool-down of the last sweep, the gaps
between sweeps when ``m < p``, the fill of the next group) or until the end; a ``W`` never delays
an ``F`` or ``B`` (timed with the given ``costs``, default unit costs, like the simulator).
"""

from __future__ import annotations

from collections import deque

from ..capabilities import Capabilities, Chunks, DataParallel
from ..ir import BW, B, F, Op, OpKind, W
from ..placement import loop_placement
from ..registry import ScheduleInfo, register
from ..schedule import Schedule, build_schedule
from .common import ScheduleParameterError, check_int, reject_unsupported, stage_costs

__all__ = ["FSDP_MAX_UNSHARDED", "bfs", "bfs_order", "bfs_zb", "fill_w"]

#: Breadth-first order uses one chunk's weights for a whole sweep: one gathered chunk suffices.
FSDP_MAX_UNSHARDED = 1


def bfs_order(p: int, m: int, v: int, group: int, backward: OpKind = OpKind.BW) -> list[list[Op]]:
    """Per rank, breadth-first sweeps group by group (see the module doc); ``backward`` is BW or B."""
    back = BW if backward == OpKind.BW else B
    rows: list[list[Op]] = [[] for _ in range(p)]
    for start in range(0, m, group):
        mbs = range(start, min(start + group, m))
        for r, row in enumerate(rows):
            row += [F(c * p + r, i) for c in range(v) for i in mbs]  # forward sweeps, chunk 0 first
            row += [back(c * p + r, i) for c in reversed(range(v)) for i in mbs]  # backward sweeps, reversed
    return rows


def fill_w(p: int, rows: list[list[Op]], group: int, costs: object = None) -> list[list[Op]]:
    """Insert each ``B``'s ``W`` into the first idle slot of its rank that fits it whole (never
    delaying an ``F`` or ``B``); the ``W`` passes of a group left over run before the next group's
    first ``B`` (so at most two groups' activations are alive), the last group's at the end. Loop
    placement; timed like the simulator: an op starts when its rank is free and its input arrived
    (``t_comm`` later across ranks)."""
    num_stages = max((op.stage for row in rows for op in row), default=0) + 1
    sc = stage_costs(costs, num_stages)
    last = num_stages - 1
    end: dict[Op, float] = {}
    out: list[list[Op]] = [[] for _ in rows]
    pending: list[deque[Op]] = [deque() for _ in rows]
    pos, clock = [0] * p, [0.0] * p

    def ready(op: Op, rank: int) -> float | None:
        """When ``op``'s input is there, or None if its producer has not been timed yet."""
        s, i = op.stage, op.microbatch
        if op.kind == OpKind.F:
            producer = F(s - 1, i) if s > 0 else None
        else:
            producer = F(s, i) if s == last else B(s + 1, i)
        if producer is None:
            return 0.0
        if producer not in end:
            return None
        return end[producer] + (0.0 if producer.stage % p == rank else sc.comm)

    progress = True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(rows[r]):
                op = rows[r][pos[r]]
                at = ready(op, r)
                if at is None:
                    break
                fits = pending[r] and clock[r] + sc.w[pending[r][0].stage] <= at  # an idle slot a W fits in
                overdue = (
                    op.kind == OpKind.B and pending[r] and pending[r][0].microbatch // group < op.microbatch // group
                )
                if fits or overdue:
                    w = pending[r].popleft()
                    out[r].append(w)
                    clock[r] += sc.w[w.stage]
                    continue
                start = max(clock[r], at)
                clock[r] = end[op] = start + (sc.f if op.kind == OpKind.F else sc.b)[op.stage]
                out[r].append(op)
                if op.kind == OpKind.B:
                    pending[r].append(W(op.stage, op.microbatch))
                pos[r] += 1
                progress = True
    if any(pos[r] < len(rows[r]) for r in range(p)):  # pragma: no cover - bfs orders are deadlock-free
        raise ScheduleParameterError("bfs-zb: the F/B order cannot be timed (a rank waits forever)")
    return [row + list(rest) for row, rest in zip(out, pending, strict=True)]


def _check(schedule: str, p: int, m: int, v: int | None, group: int | None) -> tuple[int, int]:
    check_int("p", p, 1)
    check_int("m", m, 1)
    v = 2 if v is None else check_int("v", v, 1)
    group = m if group is None else check_int("microbatch_group_size", group, 1)
    if group > m:
        raise ScheduleParameterError(
            f"{schedule}: microbatch_group_size (micro-batches per breadth-first group) must be in 1..m = 1..{m}, "
            f"got {group}"
        )
    return v, group


def bfs(
    p: int, m: int, *, v: int | None = None, microbatch_group_size: int | None = None, **unused: object
) -> Schedule:
    """Breadth-first looped schedule, ``v`` chunks per rank (default 2), groups of ``microbatch_group_size``
    micro-batches (default ``m``: pure breadth-first)."""
    v, group = _check("bfs", p, m, v, microbatch_group_size)
    reject_unsupported("bfs", unused)
    return build_schedule(
        "bfs",
        loop_placement(p, v),
        m,
        bfs_order(p, m, v, group),
        v=v,
        microbatch_group_size=group,
        fsdp_max_unsharded=FSDP_MAX_UNSHARDED,
    )


def bfs_zb(
    p: int,
    m: int,
    *,
    v: int | None = None,
    microbatch_group_size: int | None = None,
    costs: object = None,
    **unused: object,
) -> Schedule:
    """``bfs`` with split backwards; the ``W`` passes fill idle slots (see the module doc)."""
    v, group = _check("bfs-zb", p, m, v, microbatch_group_size)
    reject_unsupported("bfs-zb", unused)
    rows = fill_w(p, bfs_order(p, m, v, group, OpKind.B), group, costs)
    return build_schedule(
        "bfs-zb",
        loop_placement(p, v),
        m,
        rows,
        v=v,
        microbatch_group_size=group,
        fsdp_max_unsharded=FSDP_MAX_UNSHARDED,
    )


_CONSTRAINTS = "p >= 1, m >= 1, v >= 1 (default 2), 1 <= microbatch_group_size <= m (default m)"


def _capabilities(costs: bool) -> Capabilities:
    return Capabilities(
        chunks=Chunks(low=1, high=None, default=2, refusal="{name} needs v >= 1 chunks per rank, got v={v!r}"),
        costs=costs,
        keywords=("microbatch_group_size",),
        data_parallel=DataParallel(fsdp="optional"),
    )


register(
    ScheduleInfo(
        "bfs",
        bfs,
        "loop",
        False,
        _CONSTRAINTS,
        "breadth-first looped: every micro-batch through one chunk, then the next; backwards in reverse; "
        "per-chunk DP reduce overlaps the backward, FSDP gathers once per sweep",
        family="breadth-first",
        capabilities=_capabilities(costs=False),
    )
)
register(
    ScheduleInfo(
        "bfs-zb",
        bfs_zb,
        "loop",
        True,
        _CONSTRAINTS,
        "breadth-first looped with split B/W: deferred W passes fill the idle slots",
        family="breadth-first",
        capabilities=_capabilities(costs=True),
    )
)
