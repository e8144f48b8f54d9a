"""BitPipe: two V-shaped interleaved pipelines running in opposite directions (Wu, Chen, Yu,
"BitPipe: Bidirectional Interleaved Pipeline Parallelism for Accelerating Large Models Training",
arXiv 2410.19367, section "V-shaped interleaved schedule" and Figure 3).

Placement (:func:`~megatron_pp_ext.schedules.placement.bidirectional_placement`): ``2p`` stages per
replica, four chunks per rank. The *down* replica's micro-batches enter on rank 0 (chunk 0), run
down to rank ``p-1``, turn there without communication and come back on chunk 2; the *up*
replica's enter on rank ``p-1`` (chunk 1), turn on rank 0 and come back on chunk 3. Micro-batches
go in rounds of ``p``: the first ``p/2`` of a round take the down replica, the next ``p/2`` the up
replica (Figure 3: micro-batches 1, 2 down, 3, 4 up).

Per rank the order is the papers' warm-up / steady 1F1B / cool-down:

1. **forward order**: round by round; inside a round the forwards come in the order in which
   they reach the rank when each end injects one micro-batch every two forward slots (down
   micro-batch ``k`` of the round is on rank ``r`` at slot ``2k + r`` on its first chunk and
   ``2k + 2p-1-r`` on its second; an up one at ``2k + p-1-r`` and ``2k + p + r``). As ``p`` is
   even, ``r`` and ``p-1-r`` differ in parity, so the two directions take alternate slots: this
   is why BitPipe needs an even ``p``.
2. **backward order**: the same with backward slots (down: chunk 2 at ``2k + r``, chunk 0 at
   ``2k + 2p-1-r``; up: chunk 3 at ``2k + p-1-r``, chunk 1 at ``2k + p + r``).
3. **warm-up**: ``w = p + p/2 + min(r, p-1-r)`` forwards (Figure 3 shows ``w + 1`` before the
   first backward: the first steady forward);
4. **steady 1F1B**: the round's remaining ``u = 2p - w`` forwards, each followed by a backward;
5. **cool-down**: the round's remaining backwards. Between rounds (``m > p``) the cool-down of
   one round and the warm-up of the next overlap as in the authors' released code (``w-u+1``
   backwards, ``u-1`` (forward, backward) pairs, the rest of the next warm-up): see :func:`_phases`.

For ``p = 4, m = 4`` this reproduces Figure 3 op for op (``tests/schedules/test_bitpipe.py``).
With ``T_F = T_BW`` the bubble is exactly ``(p-2)/(4m+p-2)`` and rank ``r`` peaks at
``w + 1`` stage activations (half a 1F1B stage each); with the simulator's unit costs
(``T_BW = 2 T_F``) every round boundary adds ``(p-2)(T_BW - T_F)`` of idle time.

``bitpipe`` runs unsplit backwards (``BW``) as the paper does. ``bitpipe-zb`` keeps the same
F/B order and splits every backward into ``B`` and ``W``; a ``W`` runs in the first slot where
its rank would otherwise wait for an input (under unit costs), mostly in the cool-downs, never
holding more activations than ``bitpipe`` does (:func:`_fill_w`).
"""

from __future__ import annotations

from ..capabilities import Capabilities, Chunks
from ..ir import BW, B, F, Op, W
from ..placement import bidirectional_placement
from ..registry import ScheduleInfo, register
from ..schedule import Schedule, build_schedule
from .common import ScheduleParameterError, check_int, reject_unsupported

__all__ = ["BITPIPE_CONSTRAINTS", "bitpipe", "bitpipe_rounds", "bitpipe_zb", "warmup_forwards"]

BITPIPE_CONSTRAINTS = (
    "-p/--pipeline-model-parallel-size even >= 2, -m (micro-batches) a multiple of p; "
    "two model replicas, 2p stages each (layers divisible by 2p)"
)

DOWN, UP = 0, 1


def _check(schedule: str, p: object, m: object, v: object) -> None:
    check_int("p (-p/--pipeline-model-parallel-size)", p, 2)
    check_int("m (-m, number of micro-batches)", m, 1)
    assert isinstance(p, int) and isinstance(m, int)
    if p % 2:
        raise ScheduleParameterError(
            f"{schedule} needs an even pipeline size -p/--pipeline-model-parallel-size (2, 4, 6, ...): "
            f"the two directions share the ranks in alternate slots; got p={p}"
        )
    if m % p:
        raise ScheduleParameterError(
            f"{schedule} needs -m (number of micro-batches) to be a multiple of p={p} "
            f"(rounds of p/2 down and p/2 up micro-batches): got m={m}; valid: {p}, {2 * p}, {3 * p}, ..."
        )
    if v is not None and v != 4:
        raise ScheduleParameterError(
            f"{schedule} runs 4 chunks per rank (two V-shaped replicas): v must be 4 (or not given), got {v!r}"
        )


def bitpipe_rounds(p: int, m: int) -> tuple[int, ...]:
    """Replica of every micro-batch: rounds of ``p``, the first ``p/2`` down (0), the rest up (1)."""
    return tuple(DOWN if i % p < p // 2 else UP for i in range(m))


def warmup_forwards(p: int, r: int) -> int:
    """Forwards rank ``r`` runs before its 1F1B phase (Figure 3: one fewer than before its first backward)."""
    return p + p // 2 + min(r, p - 1 - r)


def _stages(p: int, r: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Global stages on rank ``r``: (down first leg, down second leg), (up first leg, up second leg)."""
    s = 2 * p  # stages per replica; the up replica's global ids start at s
    return (r, 2 * p - 1 - r), (s + p - 1 - r, s + p + r)


def _orders(p: int, m: int, r: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``(stage, micro-batch)`` of rank ``r``'s forwards and backwards, in the order of steps 1 and 2."""
    down, up = _stages(p, r)
    half = p // 2
    fwd: list[tuple[int, int]] = []
    bwd: list[tuple[int, int]] = []
    for start in range(0, m, p):
        f_slots: list[tuple[int, int, int]] = []  # (slot, stage, micro-batch)
        b_slots: list[tuple[int, int, int]] = []
        for k in range(half):
            d, u = start + k, start + half + k
            f_slots += [(2 * k + r, down[0], d), (2 * k + 2 * p - 1 - r, down[1], d)]
            f_slots += [(2 * k + p - 1 - r, up[0], u), (2 * k + p + r, up[1], u)]
            b_slots += [(2 * k + r, down[1], d), (2 * k + 2 * p - 1 - r, down[0], d)]
            b_slots += [(2 * k + p - 1 - r, up[1], u), (2 * k + p + r, up[0], u)]
        fwd += [(stage, mb) for _, stage, mb in sorted(f_slots)]
        bwd += [(stage, mb) for _, stage, mb in sorted(b_slots)]
    return fwd, bwd


def _phases(p: int, m: int, r: int) -> list[tuple[str, int, int]]:
    """Steps 3-5 on rank ``r``, round by round: ``("F" | "B", stage, micro-batch)``.

    With ``n = 2p`` forwards (and backwards) per round on a rank, ``w`` warm-up forwards and
    ``u = n - w`` steady pairs, the last round ends in a plain cool-down; every earlier round ``j``
    hands over to round ``j+1`` as the authors' released schedule does: its cool-down runs
    ``w-u+1`` backwards, then ``u-1`` pairs of (round ``j+1`` forward, round ``j`` backward), then
    the rest of round ``j+1``'s warm-up.
    """
    fwd, bwd = _orders(p, m, r)
    n, w = 2 * p, warmup_forwards(p, r)
    u = n - w

    def f(j: int, i: int) -> tuple[str, int, int]:
        return ("F", *fwd[j * n + i])

    def b(j: int, i: int) -> tuple[str, int, int]:
        return ("B", *bwd[j * n + i])

    rounds = m // p
    row = [f(0, i) for i in range(w)]  # warm-up
    for j in range(rounds):
        for k in range(u):  # steady 1F1B
            row += [f(j, w + k), b(j, k)]
        if j == rounds - 1:  # cool-down
            row += [b(j, i) for i in range(u, n)]
            break
        row += [b(j, i) for i in range(u, w + 1)]  # cool-down of round j ...
        for k in range(u - 1):  # ... meets the warm-up of round j+1
            row += [f(j + 1, k), b(j, w + 1 + k)]
        row += [f(j + 1, i) for i in range(u - 1, w)]
    return row


def bitpipe(p: int, m: int, *, v: int | None = None, **unused: object) -> Schedule:
    """BitPipe with unsplit backwards (``BW``), as in the paper."""
    _check("bitpipe", p, m, v)
    reject_unsupported("bitpipe", unused)
    ops = [[F(s, mb) if kind == "F" else BW(s, mb) for kind, s, mb in _phases(p, m, r)] for r in range(p)]
    return build_schedule("bitpipe", bidirectional_placement(p), m, ops, bitpipe_rounds(p, m))


def _fill_w(p: int, rows: list[list[tuple[str, int, int]]], replicas: tuple[int, ...]) -> list[list[Op]]:
    """Split every backward; run each ``W`` in the first slot where its rank would otherwise wait.

    Dataflow timing with ``T_F = T_B = T_W = 1``: a rank whose next ``F``/``B`` has no input yet
    runs its oldest pending ``W`` instead. A rank keeps at most ``warm-up + 1`` activations alive
    (bitpipe's own peak): it flushes pending ``W`` passes before going above that.
    """
    last = 2 * p - 1  # position of the loss stage within a replica
    done: dict[tuple[str, int, int], float] = {}
    out: list[list[Op]] = [[] for _ in range(p)]
    pending: list[list[tuple[int, int]]] = [[] for _ in range(p)]
    live, clock, pc = [0] * p, [0.0] * p, [0] * p
    caps = [warmup_forwards(p, r) + 1 for r in range(p)]

    def ready(kind: str, s: int, mb: int) -> float:
        pos = s - replicas[mb] * 2 * p
        if kind == "F":
            return 0.0 if pos == 0 else done.get(("F", s - 1, mb), float("inf"))
        return done.get(("F", s, mb) if pos == last else ("B", s + 1, mb), float("inf"))

    def run(r: int, op: Op, key: tuple[str, int, int]) -> None:
        out[r].append(op)
        clock[r] += 1.0
        done[key] = clock[r]

    remaining = sum(map(len, rows))
    while remaining:
        # the rank whose next F/B can start earliest goes next (ties: lowest rank)
        starts = [max(clock[r], ready(*rows[r][pc[r]])) if pc[r] < len(rows[r]) else float("inf") for r in range(p)]
        r = min(range(p), key=lambda q: (starts[q], q))
        kind, s, mb = rows[r][pc[r]]
        while pending[r] and (starts[r] >= clock[r] + 1.0 or (kind == "F" and live[r] >= caps[r])):
            ws, wmb = pending[r].pop(0)  # fill the gap (or make room) with the oldest W
            run(r, W(ws, wmb), ("W", ws, wmb))
            live[r] -= 1
        clock[r] = max(clock[r], starts[r])
        if kind == "F":
            run(r, F(s, mb), ("F", s, mb))
            live[r] += 1
        else:
            run(r, B(s, mb), ("B", s, mb))
            pending[r].append((s, mb))
        pc[r] += 1
        remaining -= 1
    for r in range(p):
        out[r] += [W(s, mb) for s, mb in pending[r]]
    return out


def bitpipe_zb(p: int, m: int, *, v: int | None = None, **unused: object) -> Schedule:
    """BitPipe's F/B order with split backwards; ``W`` passes fill the gaps (mostly the cool-down)."""
    _check("bitpipe-zb", p, m, v)
    reject_unsupported("bitpipe-zb", unused)
    replicas = bitpipe_rounds(p, m)
    ops = _fill_w(p, [_phases(p, m, r) for r in range(p)], replicas)
    return build_schedule("bitpipe-zb", bidirectional_placement(p), m, ops, replicas)


BITPIPE = Capabilities(
    chunks=Chunks(
        low=4,
        high=4,
        default=4,
        refusal="{name} holds 4 chunks per rank (two V-shaped replicas): v must be 4 (or not given), got v={v!r}",
    ),
    min_p=2,
    too_few_ranks="{name}: p (-p/--pipeline-model-parallel-size) must be >= 2 and even, got p={p}",
)

register(
    ScheduleInfo(
        "bitpipe",
        bitpipe,
        "bidirectional",
        False,
        BITPIPE_CONSTRAINTS,
        "BitPipe: two V-shaped interleaved pipelines in opposite directions, 1F1B, unsplit backwards",
        family="bidirectional",
        capabilities=BITPIPE,
    )
)
register(
    ScheduleInfo(
        "bitpipe-zb",
        bitpipe_zb,
        "bidirectional",
        True,
        BITPIPE_CONSTRAINTS,
        "BitPipe's order with B/W split: W passes deferred into the cool-down bubbles",
        family="bidirectional",
        capabilities=BITPIPE,
    )
)
