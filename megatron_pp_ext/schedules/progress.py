"""The executor's p2p protocol as a rule of progress: which send bound a lowered schedule can afford.

Semantics (what :mod:`megatron_pp_ext.runtime.channels` does on a backend whose transfers progress on
their own, e.g. gloo): each rank runs its ops in order. At gap ``g`` it posts its sends (a send
completes once its receiver has posted the matching receive) and its receives (posting never
blocks); an op waits only for the sender of its own input to have posted that message. A rank keeps
at most ``bound`` sends pending: past that it waits until enough of them are matched. At the end it
waits for all its sends.

A send bound that is too small can deadlock where the unbounded protocol would not: rank A waits
for a receive rank B posts only after consuming something A sends later. :func:`run_posted` runs
the programs under these semantics (progress is monotone: posting earlier never delays anybody, so
one run decides) and reports whether every rank finishes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

__all__ = ["run_posted"]


def run_posted(
    lengths: Sequence[int],
    src: Sequence[int],
    dst: Sequence[int],
    send_gap: Sequence[int],
    post_gap: Sequence[int],
    consumer: Sequence[int],
    bounds: Sequence[int | None],
) -> list[int] | None:
    """``None`` if every rank finishes, else the gap each rank reached.

    ``lengths[r]``: ops of rank ``r``. Per message ``mid``: sender ``src``, receiver ``dst``, the gap
    of its send and of its receive's posting, the index of its consumer op on the receiver.
    ``bounds[r]``: most sends rank ``r`` keeps pending (None: no bound)."""
    p = len(lengths)
    sends_at: list[dict[int, list[int]]] = [{} for _ in range(p)]
    posts_at: list[dict[int, list[int]]] = [{} for _ in range(p)]
    needs: list[dict[int, int]] = [{} for _ in range(p)]
    for mid in range(len(src)):
        sends_at[src[mid]].setdefault(send_gap[mid], []).append(mid)
        posts_at[dst[mid]].setdefault(post_gap[mid], []).append(mid)
        needs[dst[mid]][consumer[mid]] = mid
    sent = [False] * len(src)
    posted = [False] * len(src)
    gap = [0] * p  # the gap each rank is at
    next_send = [0] * p  # sends of that gap already posted
    pending: list[deque[int]] = [deque() for _ in range(p)]
    done = [False] * p
    work = list(range(p - 1, -1, -1))
    while work:
        rank = work.pop()
        if done[rank]:
            continue
        queue = pending[rank]
        limit = bounds[rank]
        while True:
            g = gap[rank]
            at_gap = sends_at[rank].get(g, ())
            blocked = False
            while True:
                if limit is not None and len(queue) > limit and not _drain(queue, posted, limit):
                    blocked = True  # past the bound: waits for its oldest send's receiver
                    break
                if next_send[rank] == len(at_gap):
                    break
                mid = at_gap[next_send[rank]]
                sent[mid] = True
                queue.append(mid)
                next_send[rank] += 1
                work.append(dst[mid])
            if blocked:
                break
            for mid in posts_at[rank].get(g, ()):
                if not posted[mid]:
                    posted[mid] = True
                    work.append(src[mid])
            if g == lengths[rank]:
                if _drain(queue, posted, 0):
                    done[rank] = True
                break
            mid = needs[rank].get(g, -1)
            if mid >= 0 and not sent[mid]:
                break  # its input is not sent yet
            gap[rank] = g + 1
            next_send[rank] = 0
    return None if all(done) else gap


def _drain(queue: deque[int], posted: list[bool], keep: int) -> bool:
    """Drop matched sends (any position); True once at most ``keep`` are left."""
    if len(queue) > keep:
        still = [mid for mid in queue if not posted[mid]]
        queue.clear()
        queue.extend(still)
    return len(queue) <= keep
