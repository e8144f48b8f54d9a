"""Overlap pairs read off a schedule: adjacent forward and backward ops that may run as one combined step.

megatron-core's combined 1F1B (``--overlap-moe-expert-parallel-comm``) runs one micro-batch's forward
and another's backward node by node, so that each side's expert-parallel all-to-alls run under the
other's compute. Any schedule offers such steps wherever a rank's program holds a forward and a
backward (``B`` or ``BW``) of different micro-batches next to each other: 1F1B's steady state, the
interleaved and zero-bubble schedules, the V family. :func:`mark_pairs` finds them once, from the op
lists alone, and returns the schedule with them as :attr:`~.schedule.Schedule.overlap_pairs`.

A pair must not change the order of messages: the ops stay where they are, and the lowering posts the
second op's receive before the pair (both inputs arrive before it starts). That adds one wait: the
producer of the second op's input must finish before the first op starts, so it must not itself wait,
through any chain of ops and messages, for the first op (:func:`blocked_pairs` lists the pairs where it
does; the validator refuses them). The pairs are chosen greedily, rank by rank from the start of each
program; a pair whose added wait would close a cycle with the waits of pairs already chosen is left
out. A schedule that already has pairs (DualPipeV's generator marks its own) is returned unchanged.

A pair ends both of its outputs at its end (megatron's node order interleaves the two micro-batches'
layers to the last one), so in a schedule's steady state a pair whose backward input comes from the
neighbour's pair of the same step waits for that whole pair: the ranks then take turns. megatron-core
runs one extra warm-up forward in its interleaved 1F1B when the flag is on for that reason.
:func:`deepen` is that move for any schedule: every backward (and ``W``) of a rank goes ``lag`` forwards
later, so each pair's backward input was produced a step earlier (more micro-batches in flight, more
activation memory); the lag of each rank is chosen by simulation
(:mod:`megatron_pp_ext.analysis.overlap_order`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from .ir import OpKind
from .lowering import _inputs
from .op_arrays import KIND_B, KIND_BW, KIND_F, op_arrays
from .schedule import Schedule

__all__ = ["blocked_pairs", "candidate", "deepen", "mark_pairs", "reach_table"]

_BACKWARD = (OpKind.B, OpKind.BW)


def candidate(schedule: Schedule, rank: int, i: int) -> bool:
    """Ops ``i`` and ``i + 1`` of ``rank`` are one forward and one backward (B/BW) of different micro-batches."""
    first, second = schedule.ops[rank][i], schedule.ops[rank][i + 1]
    kinds = (first.kind, second.kind)
    one_each = (kinds[0] == OpKind.F and kinds[1] in _BACKWARD) or (kinds[1] == OpKind.F and kinds[0] in _BACKWARD)
    return one_each and first.microbatch != second.microbatch


def _edges(schedule: Schedule, extra: Sequence[tuple[int, int]] = ()) -> tuple[list[list[int]], int]:
    """Successors of every op (global ids): the next op of its rank, the consumers of its output on
    other stages, and ``extra`` (``(before, after)`` pairs)."""

    arrays = op_arrays(schedule)
    n = arrays.total
    succ: list[list[int]] = [[] for _ in range(n)]
    for rank in range(schedule.num_ranks):
        lo, hi = arrays.offsets[rank], arrays.offsets[rank + 1]
        for g in range(lo, hi - 1):
            succ[g].append(g + 1)
    consumer, producer, _ = _inputs(schedule, arrays)
    for c, p in zip(consumer.tolist(), producer.tolist(), strict=True):
        succ[p].append(c)
    for before, after in extra:
        succ[before].append(after)
    return succ, n


def _topological(succ: list[list[int]], n: int) -> list[int] | None:
    """Kahn's order of the ops, or None when the waits form a cycle."""
    indegree = [0] * n
    for targets in succ:
        for t in targets:
            indegree[t] += 1
    ready = deque(g for g in range(n) if indegree[g] == 0)
    order = []
    while ready:
        g = ready.popleft()
        order.append(g)
        for t in succ[g]:
            indegree[t] -= 1
            if indegree[t] == 0:
                ready.append(t)
    return order if len(order) == n else None


def reach_table(schedule: Schedule) -> np.ndarray:
    """``reach[g, q]``: the first position on rank ``q`` of an op that waits (directly or through other
    ops and messages) for op ``g``, or on ``g``'s own rank ``g``'s position; a large number if none."""
    arrays = op_arrays(schedule)
    succ, n = _edges(schedule)
    order = _topological(succ, n)
    if order is None:
        raise ValueError(f"schedule {schedule.name!r}: its ops wait for each other in a cycle")
    big = np.iinfo(np.int64).max
    reach = np.full((n, schedule.num_ranks), big, dtype=np.int64)
    rank, index = arrays.rank, arrays.index
    for g in reversed(order):
        row = reach[g]
        for t in succ[g]:
            np.minimum(row, reach[t], out=row)
        row[rank[g]] = index[g]
    return reach


def _producers(schedule: Schedule) -> dict[int, list[int]]:

    consumer, producer, _ = _inputs(schedule, op_arrays(schedule))
    found: dict[int, list[int]] = {}
    for c, p in zip(consumer.tolist(), producer.tolist(), strict=True):
        found.setdefault(c, []).append(p)
    return found


def blocked_pairs(schedule: Schedule) -> list[tuple[int, int]]:
    """The marked pairs ``(rank, index of the first op)`` whose second op's input cannot arrive before the
    pair: a producer of it waits, through any chain of ops, messages and the waits the other pairs add,
    for the pair's first op. Linear when there is none (one topological sort); otherwise one search per pair."""
    if not schedule.overlap_pairs:
        return []
    offsets = op_arrays(schedule).offsets
    producers = _producers(schedule)
    firsts = [(rank, i, offsets[rank] + i) for rank, starts in enumerate(schedule.overlap_pairs) for i in starts]
    extra = [(p, first) for _, _, first in firsts for p in producers.get(first + 1, [])]
    succ, n = _edges(schedule, extra)
    if _topological(succ, n) is not None:
        return []
    return [(r, i) for r, i, first in firsts if any(_reaches(succ, first, p) for p in producers.get(first + 1, []))]


def deepen(schedule: Schedule, lags: Sequence[int]) -> Schedule:
    """``schedule`` with every non-forward op of rank ``r`` moved ``lags[r]`` forwards later on its rank
    (no later than after its rank's last forward); the forwards keep their order, the other ops theirs.
    The result may deadlock (waits in a cycle): the caller validates it."""
    if len(lags) != schedule.num_ranks or any(lag < 0 for lag in lags):
        raise ValueError(f"lags: one number >= 0 per rank ({schedule.num_ranks}), got {list(lags)}")
    rows = []
    for row, lag in zip(schedule.ops, lags, strict=True):
        forwards = sum(op.kind == OpKind.F for op in row)
        keyed = []
        seen = 0
        for j, op in enumerate(row):
            if op.kind == OpKind.F:
                keyed.append((seen, 1, j, op))  # the seen-th forward
                seen += 1
            else:  # after ``seen + lag`` forwards, before the next one
                keyed.append((min(seen + lag, forwards), 0, j, op))
        keyed.sort(key=lambda t: t[:3])
        rows.append(tuple(t[3] for t in keyed))
    return Schedule(
        placement=schedule.placement,
        num_microbatches=schedule.num_microbatches,
        ops=tuple(rows),
        name=schedule.name,
        microbatch_replicas=schedule.microbatch_replicas,
        params={**schedule.params, "pair_lags": tuple(lags)},
    )


def mark_pairs(schedule: Schedule) -> Schedule:
    """``schedule`` with its overlap pairs marked (see the module docstring); unchanged if it has pairs."""
    if schedule.overlap_pairs:
        return schedule
    arrays = op_arrays(schedule)
    kind = arrays.kind
    if not ((kind == KIND_F).any() and ((kind == KIND_B) | (kind == KIND_BW)).any()):
        return schedule
    reach = reach_table(schedule)
    producers = _producers(schedule)
    succ, _ = _edges(schedule)
    chosen: list[tuple[int, int]] = []  # (rank, index of the pair's first op)
    for rank, row in enumerate(schedule.ops):
        i = 0
        while i < len(row) - 1:
            first = arrays.offsets[rank] + i
            inputs = producers.get(first + 1, [])
            ok = candidate(schedule, rank, i) and all(reach[first, arrays.rank[p]] > arrays.index[p] for p in inputs)
            if ok and not any(_reaches(succ, first, p) for p in inputs):  # earlier pairs' waits included
                for p in inputs:
                    succ[p].append(first)
                chosen.append((rank, i))
                i += 2
            else:
                i += 1
    if not chosen:
        return schedule
    rows: list[list[int]] = [[] for _ in schedule.ops]
    for rank, i in chosen:
        rows[rank].append(i)
    return schedule.with_overlap_pairs(rows)


def _reaches(succ: list[list[int]], start: int, target: int) -> bool:
    """Whether ``target`` waits for ``start`` through ``succ``."""
    seen = {start}
    todo = [start]
    while todo:
        for t in succ[todo.pop()]:
            if t == target:
                return True
            if t not in seen:
                seen.add(t)
                todo.append(t)
    return False
