"""A building block repeated into a schedule: repeat, squeeze, reorder (see :mod:`.building_block`).

Squeezing is the timing core's (:func:`~..order_timing.order_times` with unit passes and free hops); the
reorder is this module's policy: passes of the warm-up and cool-down move into earlier idle slots
without raising the block's memory or crossing two messages between neighbouring ranks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..costs import StageCosts
from ..engine import input_of, output_of
from ..ir import Op, OpKind
from ..order_timing import order_times
from ..placement import v_placement

if TYPE_CHECKING:
    from .building_block import BuildingBlock

__all__ = ["compact"]

_DELTA = {OpKind.F: 1, OpKind.B: 0, OpKind.W: -1, OpKind.BW: -1}  # live activations per op


def compact(block: BuildingBlock, m: int, caps: list[int]) -> list[list[Op]]:
    """Repeat, squeeze and reorder (module doc); return each rank's order."""
    p, t = block.num_ranks, block.interval
    order = []
    steady: set[Op] = set()  # passes of the full repetition: never reordered
    for off, r in zip(block.offsets, range(p), strict=True):
        ops = [block.ops(r, k) for k in range(m)]
        slots = sorted((off[x] + k * t, x, k) for k in range(m) for x in range(6))
        order.append([ops[k][x] for _, x, k in slots])
        # slots where every pass of the block is some micro-batch's: [last first-block pass, first missing)
        lo, hi = max(off), min(off) + m * t
        steady.update(ops[k][x] for slot, x, k in slots if lo <= slot < hi)
    for _ in range(_MAX_ROUNDS):
        moved = _reorder(order, p, _squeeze(order, m), caps, steady)
        if moved == order:
            break
        order = moved
    return order


_MAX_ROUNDS = 4  # squeeze-and-reorder rounds; the published blocks settle within three


def _squeeze(order: list[list[Op]], m: int) -> dict[Op, int]:
    """Start slot of every op when each rank runs its order as early as its inputs allow (unit
    passes, free hops: the timing core's :func:`~..order_timing.order_times`)."""
    stages = 2 * len(order)
    unit = StageCosts((1.0,) * stages, (1.0,) * stages, (1.0,) * stages, 0.0)
    starts = order_times(v_placement(len(order)), m, unit, order).starts
    return {op: int(at) for row, times in zip(order, starts, strict=True) for op, at in zip(row, times, strict=True)}


def _reorder(
    order: list[list[Op]],
    p: int,
    start: dict[Op, int],
    caps: list[int],
    steady: set[Op],
) -> list[list[Op]]:
    """Move passes into earlier idle slots of the squeezed timeline (module doc, step 3).

    The lowering batches a rank's sends after an op with its receives before the next op, and
    a batch completes only when every peer has posted its side. That cannot deadlock when, for
    every pair of neighbouring ranks, the messages between them come in the same order on both
    sides (messages in one batch count as simultaneous). The plain repetition has this
    property and every move keeps it: a move is refused when it would put two messages in
    opposite orders on the two ranks.
    Long because the move loop and the message-order guard keep one invariant and read best together.
    """
    last = 2 * p - 1
    horizon = max(start.values()) + 2
    grid: list[list[Op | None]] = [[None] * horizon for _ in range(p)]
    level = [[0] * horizon for _ in range(p)]  # live activations after each slot
    slot_of = dict(start)
    items = sorted((slot, r, op) for r, row in enumerate(order) for op in row for slot in (start[op],))
    for slot, r, op in items:
        grid[r][slot] = op
    for r in range(p):
        live = 0
        for y, cell in enumerate(grid[r]):
            if cell is not None:
                live += _DELTA[cell.kind]
            level[r][y] = live

    def rank_of(stage: int) -> int:
        return stage if stage < p else last - stage

    def next_op_slot(rank: int, slot: int) -> int:
        row = grid[rank]
        y = slot + 1
        while y < horizon and row[y] is None:
            y += 1
        return y

    # An event is (peer rank, position of the peer's side on the peer): a send's partner is the
    # consumer's receive (before the consumer's slot), a receive's partner the producer's send
    # (in the batch before the producer's next op).
    def send_event(op: Op | None, r: int) -> tuple[int, int] | None:
        consumer = None if op is None else output_of(op, last)
        if consumer is None:
            return None
        q = rank_of(consumer.stage)
        return None if q == r else (q, slot_of[consumer])

    def recv_event(op: Op | None, r: int) -> tuple[int, int] | None:
        producer = None if op is None else input_of(op, last)
        if producer is None:
            return None
        q = rank_of(producer.stage)
        return None if q == r else (q, next_op_slot(q, slot_of[producer]))

    def clash(first: tuple[int, int] | None, then: tuple[int, int] | None) -> bool:
        """``first`` now strictly precedes ``then`` on this rank; on their shared peer it must not follow."""
        return first is not None and then is not None and first[0] == then[0] and then[1] < first[1]

    for slot, r, op in items:
        # after its inputs and after the same pass of the previous micro-batch on this rank
        dep = input_of(op, last)
        earliest = 0 if dep is None else slot_of[dep] + 1
        if op.microbatch > 0:
            earliest = max(earliest, slot_of[op._replace(microbatch=op.microbatch - 1)] + 1)
        if earliest >= slot or op in steady:
            continue
        row, lev = grid[r], level[r]
        is_forward = op.kind is OpKind.F
        cap = caps[r]
        mine_recv, mine_send = recv_event(op, r), send_event(op, r)
        follower = row[next_op_slot(r, slot)] if next_op_slot(r, slot) < horizon else None
        is_backward = op.kind is OpKind.B
        first_passed: Op | None = None  # the earliest op the move jumps over
        target, swap = slot, False
        deferred_peak = -1  # most activations alive over [y, slot) (for deferring a W to ``slot``)
        for y in range(slot - 1, earliest - 1, -1):
            if is_forward and lev[y] >= cap:
                break
            deferred_peak = max(deferred_peak, lev[y])
            here = row[y]
            if here in steady:  # the repetition's own order stays
                break
            if here is None:  # an idle slot: the op before it now sends before first_passed receives
                below = y - 1
                while below >= 0 and row[below] is None:
                    below -= 1
                if (
                    first_passed is None
                    or below < 0
                    or not clash(send_event(row[below], r), recv_event(first_passed, r))
                ):
                    target, swap = y, False
                continue
            if is_backward and here.kind is OpKind.W and deferred_peak < cap:
                # take the weight pass's slot; it moves to ours (later), where it keeps its activation longer
                if first_passed is not None or not clash(mine_send, recv_event(follower, r)):
                    target, swap = y, True
            # jump over ``here``: its messages now follow ours
            previous = recv_event(first_passed if first_passed is not None else follower, r)
            if (
                clash(mine_recv, recv_event(here, r))
                or clash(mine_recv, send_event(here, r))
                or clash(mine_send, send_event(here, r))
                or clash(mine_send, previous)
            ):
                break
            first_passed = here
        if target != slot:
            displaced = row[target] if swap else None
            row[target], row[slot] = op, displaced
            delta = _DELTA[op.kind] - (_DELTA[displaced.kind] if displaced is not None else 0)
            if delta:
                for y in range(target, slot):
                    lev[y] += delta
            slot_of[op] = target
            if displaced is not None:
                slot_of[displaced] = slot
    return [[op for op in row if op is not None] for row in grid]
