"""Run lowered programs under rendezvous semantics, optionally repairing wait-for cycles.

Semantics (the strictest a backend may have, e.g. NCCL's batched p2p): each rank runs its ops
in order; at every position where it has messages it posts one batch of sends and receives and
waits until each of them is matched. A send is matched once its receiver has reached (posted)
the batch holding the receive, a receive once its sender has reached the batch holding the send.
Computes never block, so a rank goes straight from one batch to the next.

Messages are plain ids; the caller gives, per message, its sender and receiver rank and the
position of the batch that holds its send (``send_pos``) and its receive (``recv_pos``) on those
ranks, and per rank its ``events``: ``(position, message id, is_receive)`` sorted by position.

With ``repair`` the run fixes the cycles a lowering creates by placing every receive just before
its consumer: when no rank can move and a rank waits to send to a receiver that is blocked in an
earlier batch, the receive moves into that earlier batch (``recv_pos`` is updated in place). The
receiver waits there anyway and the data is ready, so the move only removes the cycle; one move
per pair of ranks per round, activations (``is_grad`` 0) first, as megatron's own schedules post
such receives early. A cycle in the data dependencies themselves stays and is reported.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

__all__ = ["RankEvents", "events_by_rank", "run_rendezvous"]

_END = 1 << 62  # position of a rank that has finished


class RankEvents(NamedTuple):
    """One rank's batches: batch ``b`` sits at ``positions[b]`` and holds events
    ``starts[b]:starts[b+1]``, sends first. Event ``j``: message ``mids[j]`` with ``peers[j]``;
    ``needs[j]`` is the peer's position a receive waits for (its send's), -1 for a send (it waits
    for the receive's position, which a repair may change)."""

    positions: list[int]
    starts: list[int]
    mids: list[int]
    peers: list[int]
    needs: list[int]


def events_by_rank(
    p: int, src: np.ndarray, dst: np.ndarray, send_pos: np.ndarray, recv_pos: np.ndarray
) -> list[RankEvents]:
    """Every rank's :class:`RankEvents` from the messages' ranks and positions."""
    n = len(src)
    ids = np.arange(n, dtype=np.int64)
    rank = np.concatenate((src, dst))
    pos = np.concatenate((send_pos, recv_pos))
    is_recv = np.concatenate((np.zeros(n, np.int64), np.ones(n, np.int64)))
    order = np.lexsort((is_recv, pos, rank))
    rank, pos, is_recv = rank[order], pos[order], is_recv[order]
    mids = np.concatenate((ids, ids))[order]
    peers = np.where(is_recv == 1, src[mids], dst[mids])
    needs = np.where(is_recv == 1, send_pos[mids], -1)
    first = np.ones(len(rank), dtype=bool)
    first[1:] = (rank[1:] != rank[:-1]) | (pos[1:] != pos[:-1])
    batch_start = np.flatnonzero(first)
    rank_events = np.searchsorted(rank, np.arange(p + 1))
    rank_batches = np.searchsorted(rank[batch_start], np.arange(p + 1))
    out = []
    for r in range(p):
        lo, hi = int(rank_events[r]), int(rank_events[r + 1])
        starts = batch_start[rank_batches[r] : rank_batches[r + 1]]
        out.append(
            RankEvents(
                pos[starts].tolist(),
                [*(starts - lo).tolist(), hi - lo],
                mids[lo:hi].tolist(),
                peers[lo:hi].tolist(),
                needs[lo:hi].tolist(),
            )
        )
    return out


def run_rendezvous(
    events: Sequence[RankEvents],
    recv_pos: list[int],
    *,
    is_grad: Sequence[int] = (),
    repair: bool = False,
) -> list[int] | None:
    """Run every rank to its end; ``None`` if all finish, else the position each rank reached
    (a rank that finished shows a position past all its batches).

    ``recv_pos[mid]``: position of the batch receiving message ``mid`` on its receiver. With
    ``repair`` (needs ``is_grad``) receives move earlier as described in the module doc,
    updating ``recv_pos`` in place.
    """
    p = len(events)
    at = [ev.positions[0] if ev.positions else _END for ev in events]  # the batch each rank has posted
    current = [0] * p  # index of that batch
    blocked_sending: dict[int, tuple[int, int]] = {}  # rank -> (message, receiver) of the send it waits on
    finished = at.count(_END)
    work = list(range(p - 1, -1, -1))
    queued = [True] * p
    while True:
        while work:
            rank = work.pop()
            queued[rank] = False
            positions, starts, mids, peers, needs = events[rank]
            last = len(positions)
            b = current[rank]
            j = starts[b] if b < last else 0
            while b < last:
                end = starts[b + 1]
                while j < end:  # every event of batch b, sends first
                    need = needs[j]
                    if need < 0:  # a send: matched once the receiver posts the receive's batch
                        if at[peers[j]] < recv_pos[mids[j]]:
                            blocked_sending[rank] = (mids[j], peers[j])
                            break
                    elif at[peers[j]] < need and recv_pos[mids[j]] == positions[b]:  # (a moved receive is done)
                        break
                    j += 1
                if j < end:
                    break
                b += 1
                if b == last:
                    at[rank] = _END
                    finished += 1
                    break
                at[rank] = positions[b]
                end = starts[b + 1]
                while j < end:  # peers that may wait for this rank to post batch b
                    peer = peers[j]
                    if not queued[peer]:
                        queued[peer] = True
                        work.append(peer)
                    j += 1
                j = starts[b]
            current[rank] = b
        if finished == p:
            return None
        # A rank's entry stays until it blocks on another send; one whose send got matched since
        # has moved on (a match is final) and is dropped here.
        for rank, (mid, receiver) in list(blocked_sending.items()):
            if at[receiver] >= recv_pos[mid]:
                del blocked_sending[rank]
        if not repair or not blocked_sending:
            return at  # a real deadlock
        work = _move_blocked_receives(blocked_sending, at, recv_pos, is_grad)
        for r in work:
            queued[r] = True


def _move_blocked_receives(
    blocked_sending: dict[int, tuple[int, int]], at: list[int], recv_pos: list[int], is_grad: Sequence[int]
) -> list[int]:
    """Move receives that blocked senders wait for into their receivers' current batch; the ranks touched."""
    candidates = sorted((is_grad[mid], rank, receiver, mid) for rank, (mid, receiver) in blocked_sending.items())
    touched: list[int] = []
    busy: set[int] = set()
    for _, rank, receiver, mid in candidates:
        if rank in busy or receiver in busy:
            continue
        recv_pos[mid] = at[receiver]
        busy.update((rank, receiver))
        touched += [rank, receiver]
    return touched
