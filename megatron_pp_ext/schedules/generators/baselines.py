"""Baselines: GPipe, 1F1B (PipeDream-flush, Megatron's default) and interleaved 1F1B.

Generator convention (every family follows it): ``generate(p, m, **kwargs)`` receives only the
parameters its :class:`~..capabilities.Capabilities` declare, already checked by
:func:`~..registry.generate` (``p``, ``m``, ``v`` in range, memory limit, no unknown keyword);
it checks only the rules its declaration cannot state (here: megatron-core's group-size rules).
"""

from __future__ import annotations

from ..capabilities import Capabilities, Chunks
from ..ir import BW, F, Op, OpKind, ops_of
from ..placement import loop_placement
from ..registry import ScheduleInfo, register
from ..schedule import Schedule, build_schedule
from .common import ScheduleParameterError, check_int

#: One chunk per rank (loop placement): what GPipe and 1F1B take.
ONE_CHUNK = Capabilities(
    chunks=Chunks(
        refusal="{name} runs one chunk per rank: v must be 1 (or not given), got {v!r}; use interleaved-1f1b for v >= 2"
    )
)


def gpipe(p: int, m: int) -> Schedule:
    """All forwards, then all backwards (GPipe)."""
    ops = [[F(r, i) for i in range(m)] + [BW(r, i) for i in range(m)] for r in range(p)]
    return build_schedule("gpipe", loop_placement(p), m, ops)


def one_f_one_b(p: int, m: int) -> Schedule:
    """Rank r: ``p-r-1`` warm-up forwards, then (F, BW) pairs, then the remaining BW."""
    ops = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        row: list[Op] = [F(r, i) for i in range(warmup)]
        for i in range(m - warmup):
            row += [F(r, warmup + i), BW(r, i)]
        row += [BW(r, i) for i in range(m - warmup, m)]
        ops.append(row)
    return build_schedule("1f1b", loop_placement(p), m, ops)


# ---- interleaved 1F1B (megatron-core's forward_backward_pipelining_with_interleaving) -------------
INTERLEAVED_CONSTRAINTS = (
    "p <= microbatch_group_size (default p) <= m, m % microbatch_group_size == 0 or >= p (megatron-core 0.19.2)"
)
INTERLEAVED = Capabilities(
    chunks=Chunks(
        low=2,
        high=None,
        default=2,
        refusal="{name} needs v >= 2 virtual stages per rank, got v={v}; for v=1 use '1f1b'",
    ),
    keywords=("microbatch_group_size",),
    min_p=2,
    too_few_ranks="{name} needs p >= 2 pipeline ranks (megatron-core), got p={p}",
)


def interleaved_order(m: int, v: int, group: int) -> list[tuple[int, int]]:
    """``(microbatch, chunk)`` of each virtual micro-batch id, in forward order.

    Micro-batches go in groups of ``group``; a group runs on chunk 0, then on chunk 1, ...;
    the last group takes every remaining micro-batch. Within one chunk micro-batches
    keep their order, so the backward of virtual id ``k`` is the same micro-batch on the
    mirrored chunk ``v - 1 - chunk``.
    """
    order: list[tuple[int, int]] = []
    for start in range(0, m, group):
        stop = m if start + group >= m else start + group
        order += [(mb, chunk) for chunk in range(v) for mb in range(start, stop)]
    return order


def interleaved_warmup(p: int, rank: int, m: int, v: int, group: int) -> int:
    """Forward steps rank ``rank`` runs before its first backward (capped at ``m * v``)."""
    return min((p - rank - 1) * 2 + (v - 1) * group, m * v)


def _check_group(p: int, m: int, group: int) -> None:
    """megatron-core's rules for the micro-batch group size (p, m and v are checked by the registry)."""
    check_int("microbatch_group_size", group, 1)
    if not p <= group <= m:
        raise ScheduleParameterError(
            f"interleaved-1f1b needs p <= microbatch_group_size <= m (megatron-core), got "
            f"microbatch_group_size={group} with p={p}, m={m}" + (f"; m must be >= p = {p}" if m < p else "")
        )
    tail = m % group
    if 0 < tail < p:
        raise ScheduleParameterError(
            f"interleaved-1f1b needs m % microbatch_group_size to be 0 or >= p (megatron-core), got "
            f"m={m} % microbatch_group_size={group} = {tail} < p={p}"
        )


def interleaved_1f1b(p: int, m: int, v: int = 2, microbatch_group_size: int | None = None) -> Schedule:
    """Megatron-core's interleaved 1F1B: loop placement, chunk ``c`` of rank ``r`` is stage ``c*p + r``.

    Rank ``r`` runs ``w = min(2(p-r-1) + (v-1)g, m v)`` warm-up forwards (``g`` the
    micro-batch group size, default ``p``), then alternates forward ``w+k`` and backward ``k``,
    then the remaining backwards, with virtual ids mapped by :func:`interleaved_order`.
    """
    group = p if microbatch_group_size is None else microbatch_group_size
    _check_group(p, m, group)
    order = interleaved_order(m, v, group)
    total = m * v
    microbatches = [mb for mb, _ in order]
    chunks = [chunk for _, chunk in order]
    ops = []
    for r in range(p):
        forwards = ops_of(OpKind.F, [c * p + r for c in chunks], microbatches)  # by virtual id
        backwards = ops_of(OpKind.BW, [(v - 1 - c) * p + r for c in chunks], microbatches)
        warmup = interleaved_warmup(p, r, m, v, group)
        steady = total - warmup
        row = forwards[:warmup] + [forwards[0]] * (2 * steady) + backwards[steady:]
        row[warmup : warmup + 2 * steady : 2] = forwards[warmup:]  # forward warmup+k, then backward k
        row[warmup + 1 : warmup + 2 * steady : 2] = backwards[:steady]
        ops.append(row)
    return build_schedule("interleaved-1f1b", loop_placement(p, v), m, ops, v=v, microbatch_group_size=group)


register(
    ScheduleInfo("gpipe", gpipe, "loop", False, "", "all forwards then all backwards (GPipe)", capabilities=ONE_CHUNK)
)
register(
    ScheduleInfo(
        "1f1b", one_f_one_b, "loop", False, "", "one-forward-one-backward (Megatron default)", capabilities=ONE_CHUNK
    )
)
register(
    ScheduleInfo(
        "interleaved-1f1b",
        interleaved_1f1b,
        "loop",
        False,
        INTERLEAVED_CONSTRAINTS,
        "Megatron's interleaved 1F1B: v chunks per rank, micro-batches in groups of microbatch_group_size",
        capabilities=INTERLEAVED,
    )
)
