"""Receive pairing for one-chunk zero-bubble orders: delay forwards so that the lowering never posts a
gradient receive early (:func:`pair_receives`).

The lowering (:mod:`..lowering`) turns an order into per-rank message exchanges; when two neighbours would
each send before receiving in different exchanges, rendezvous sends would deadlock, so it posts one receive
early and that rank waits there under the simulator's ``comm="blocking"`` model. An order that passes through
:func:`pair_receives` costs the same under both communication models.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..ir import Op, OpKind

__all__ = ["pair_receives"]

_KF, _KB = OpKind.F, OpKind.B
Row = list[Op]


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
