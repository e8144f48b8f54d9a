"""DualPipeV: DeepSeek's DualPipe cut in half (DeepSeek-V3 technical report; ``dualpipe/dualpipev.py`` of
github.com/deepseek-ai/DualPipe), on the V placement (see :mod:`.vshape`).

Rank ``r`` of ``p`` holds stage ``r`` (chunk 0, "phase 0" in DeepSeek's code) and stage ``2p-1-r``
(chunk 1, "phase 1"); ``m >= 2p`` micro-batches. Per rank, eight steps, named as DeepSeek names them
(``F0`` = a chunk-0 forward, ``B1`` = a chunk-1 backward, ``W`` = a deferred weight pass):

1. ``nF0``: ``2(p-r-1)`` chunk-0 forwards (warm-up);
2. ``nF0F1``: ``r+1`` times a chunk-0 then a chunk-1 forward;
3. ``nB1W1F1``: ``p-r-1`` times a chunk-1 ``B``, its ``W`` at once, a chunk-1 forward;
4. ``nF0B1F1B0`` (main step): ``m-2p+r+1`` times the overlapped pairs ``(F0, BW1)`` and ``(F1, BW0)``;
5. ``nB1F1B0``: ``p-r-1`` times a chunk-1 backward and the overlapped pair ``(F1, BW0)``;
6. ``nB1B0``: ``r+1`` times a chunk-1 then a chunk-0 backward; from the middle on the weight
   passes are deferred (``B``), before it they are not (``BW``);
7. ``nWB0``: ``p-r-1`` times a deferred ``W`` then a chunk-0 ``B``;
8. ``nW``: the ``r+1`` ``W`` still queued.

Deferred weight passes leave a FIFO queue in the order of their ``B``. The overlapped pairs are marked in
:attr:`Schedule.overlap_pairs`: the executor may run the two ops together (a model chunk's overlap hook,
:mod:`megatron_pp_ext.runtime.executor`), the simulator times them with ``overlap=F``. As in DeepSeek's
code, the first main-step pair of the last rank is not overlapped (its forward feeds its own chunk 1).
"""

from __future__ import annotations

from collections import deque

from ..ir import BW, B, F, Op, W
from ..placement import v_placement
from ..registry import ScheduleInfo, register
from ..schedule import Schedule, build_schedule
from .common import ScheduleParameterError, reject_unsupported
from .vshape import v_capabilities

__all__ = ["dualpipev", "dualpipev_rank"]


class _Rank:
    """One rank's op list being built: per-chunk counters of forwards and backwards, the W queue."""

    def __init__(self, p: int, r: int) -> None:
        self.stage = (r, 2 * p - 1 - r)  # chunk 0, chunk 1
        self.next_f = [0, 0]
        self.next_b = [0, 0]
        self.ops: list[Op] = []
        self.pairs: list[int] = []  # index of the first op of each overlapped pair
        self.w_queue: deque[Op] = deque()

    def forward(self, chunk: int) -> None:
        self.ops.append(F(self.stage[chunk], self.next_f[chunk]))
        self.next_f[chunk] += 1

    def backward(self, chunk: int, defer_w: bool = False) -> None:
        stage, mb = self.stage[chunk], self.next_b[chunk]
        self.next_b[chunk] += 1
        self.ops.append(B(stage, mb) if defer_w else BW(stage, mb))
        if defer_w:
            self.w_queue.append(W(stage, mb))

    def weight(self) -> None:
        self.ops.append(self.w_queue.popleft())

    def forward_backward(self, f_chunk: int, b_chunk: int, overlap: bool = True) -> None:
        if overlap:
            self.pairs.append(len(self.ops))
        self.forward(f_chunk)
        self.backward(b_chunk)


def dualpipev_rank(p: int, m: int, r: int) -> tuple[list[Op], list[int]]:
    """Rank ``r``'s ops and the indices where its overlapped pairs start."""
    rank = _Rank(p, r)
    for _ in range(2 * (p - r - 1)):  # step 1: nF0
        rank.forward(0)
    for _ in range(r + 1):  # step 2: nF0F1
        rank.forward(0)
        rank.forward(1)
    for _ in range(p - r - 1):  # step 3: nB1W1F1 (zero bubble: B then its W at once)
        rank.backward(1, defer_w=True)
        rank.weight()
        rank.forward(1)
    for i in range(m - 2 * p + r + 1):  # step 4 (main step): nF0B1F1B0
        rank.forward_backward(0, 1, overlap=not (i == 0 and r == p - 1))
        rank.forward_backward(1, 0)
    for _ in range(p - r - 1):  # step 5: nB1F1B0
        rank.backward(1)
        rank.forward_backward(1, 0)
    defer = False
    for i in range(r + 1):  # step 6: nB1B0, the second half with deferred W
        if i == (r + 1) // 2 and r % 2 == 1:
            defer = True
        rank.backward(1, defer_w=defer)
        if i == (r + 1) // 2 and r % 2 == 0:
            defer = True
        rank.backward(0, defer_w=defer)
    for _ in range(p - r - 1):  # step 7: nWB0
        rank.weight()
        rank.backward(0, defer_w=True)
    for _ in range(r + 1):  # step 8: nW
        rank.weight()
    assert not rank.w_queue and rank.next_f == rank.next_b == [m, m], (r, rank.next_f, rank.next_b)
    return rank.ops, rank.pairs


def dualpipev(p: int, m: int, **unused: object) -> Schedule:
    """DualPipeV for ``p`` ranks and ``m >= 2p`` micro-batches (module doc); ``p``, ``m`` and ``v``
    are checked against the declared capabilities before this runs (``registry.generate``)."""
    reject_unsupported("dualpipev", unused)
    if m < 2 * p:
        raise ScheduleParameterError(f"dualpipev needs m >= 2p micro-batches (m >= {2 * p} for p={p}), got m={m}")
    rows = [dualpipev_rank(p, m, r) for r in range(p)]
    schedule = build_schedule("dualpipev", v_placement(p), m, [ops for ops, _ in rows])
    return schedule.with_overlap_pairs([pairs for _, pairs in rows])


register(
    ScheduleInfo(
        "dualpipev",
        dualpipev,
        "v",
        True,
        "p >= 2, m >= 2p, v = 2 (V placement)",
        "DeepSeek's DualPipeV: ZB-V-like V schedule whose (F, BW) pairs of the two chunks may run overlapped",
        family="v-shape",
        capabilities=v_capabilities("p+1"),
    )
)
