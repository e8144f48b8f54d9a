"""torch.distributed.pipelining's schedules as our IR, to validate and simulate them next to ours.

torch (2.13) builds every schedule as a per-rank ``pipeline_order``: a list of ``_Action`` per rank
(``None`` = an idle time step). Its compute-action letters differ from ours:

============  ===========================  =====
torch letter  meaning                      ours
============  ===========================  =====
``F``         forward                      ``F``
``I``         backward, input gradient     ``B``
``W``         backward, weight gradient    ``W``
``B``         full (unsplit) backward      ``BW``
============  ===========================  =====

``OVERLAP_F_B`` (DualPipeV) wraps a forward and a backward of two chunks that torch runs overlapped;
it is imported as its sub-actions in order (forward, then backward), and with ``overlap_pairs=True``
also as one of our overlap pairs (``Schedule.overlap_pairs``; the simulator's ``overlap`` factor then
credits it). The peer tables import it without the pair: the simulator charges the sum, never less.
Communication, ``UNSHARD``/``RESHARD`` and ``REDUCE_GRAD`` actions are dropped: our lowering derives
communication itself.

Stage numbering: torch's stage index is the global stage in model order, like ours. Looped
schedules put stage ``s`` on rank ``s % p`` (our ``loop`` placement); ZBVZeroBubble and DualPipeV
put stages ``r`` and ``2p-1-r`` on rank ``r`` (our ``v`` placement). The placement is inferred
from where each stage appears and checked against those two.

Single-stage orders (``PipelineScheduleSingle``: 1F1B): torch 2.13's ``Schedule1F1B._get_pipeline_order``
numbers the last rank's forwards from 1 (``F1 .. Fm`` next to ``B0 .. Bm-1``): a rank with no
warm-up forward increments the micro-batch before its first steady forward. That order is only
torch's description (its single-stage runtime runs its own loop). We handle it: on a rank whose
forwards are exactly ``1..m`` while its backwards are ``0..m-1``, forwards are renumbered ``0..m-1``
in order of appearance; :attr:`ImportedOrder.repaired_ranks` lists the ranks repaired.

Parsing works on the actions' text form (``str(action)``: ``3F1``, ``4I0``, ``(0F7;7B3)OVERLAP_F_B``)
and needs no torch; only :func:`torch_pipeline_order` imports torch, lazily.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from ..schedules.ir import Op, OpKind, ScheduleError
from ..schedules.placement import Placement, loop_placement, v_placement
from ..schedules.schedule import Schedule, build_schedule

__all__ = [
    "TORCH_SCHEDULES",
    "ImportedOrder",
    "TorchScheduleInfo",
    "import_order",
    "import_torch_schedule",
    "parse_action",
    "torch_pipeline_order",
]

_KIND = {"F": OpKind.F, "I": OpKind.B, "W": OpKind.W, "B": OpKind.BW}
_SINGLE_RE = re.compile(r"^(\d+)([A-Z_]+?)(\d*)$")
_OVERLAP_RE = re.compile(r"^\((.*)\)([A-Z_]+)$")


@dataclass(frozen=True)
class TorchScheduleInfo:
    torch_class: str  # class name in torch.distributed.pipelining.schedules
    stages_per_rank: int  # what get_schedule_ops is given (1 for single-stage schedules)
    placement: str  # loop | v
    counterparts: tuple[str, ...]  # our registry names compared with it


#: torch's schedules imported by the peer benchmark, by torch's short name.
TORCH_SCHEDULES: dict[str, TorchScheduleInfo] = {
    "GPipe": TorchScheduleInfo("ScheduleGPipe", 1, "loop", ("gpipe",)),
    "1F1B": TorchScheduleInfo("Schedule1F1B", 1, "loop", ("1f1b",)),
    "Interleaved1F1B": TorchScheduleInfo("ScheduleInterleaved1F1B", 2, "loop", ("interleaved-1f1b",)),
    "LoopedBFS": TorchScheduleInfo("ScheduleLoopedBFS", 2, "loop", ("bfs",)),
    "InterleavedZeroBubble": TorchScheduleInfo(
        "ScheduleInterleavedZeroBubble", 2, "loop", ("interleaved-zb", "bfs-zb", "zb-h1", "zb-auto")
    ),
    "ZBVZeroBubble": TorchScheduleInfo("ScheduleZBVZeroBubble", 2, "v", ("v-zb",)),
    "DualPipeV": TorchScheduleInfo("ScheduleDualPipeV", 2, "v", ("dualpipev", "v-zb")),
}


def parse_action(text: str | None) -> list[Op] | None:
    """Our compute ops for one torch action in text form, or None for a non-compute action / idle
    step. An ``OVERLAP_F_B`` becomes its sub-actions in order."""
    if text is None:
        return None
    text = str(text).strip()
    if not text:
        return None
    overlap = _OVERLAP_RE.match(text)
    if overlap:
        ops: list[Op] = []
        for part in overlap.group(1).split(";"):
            sub = parse_action(part)
            if sub:
                ops.extend(sub)
        return ops or None
    match = _SINGLE_RE.match(text)
    if match is None:
        raise ScheduleError(f"cannot parse torch action {text!r}")
    stage, kind, mb = match.groups()
    if kind not in _KIND:
        return None  # SEND_F, RECV_B, UNSHARD, RESHARD, REDUCE_GRAD: derived by our lowering
    if not mb:
        raise ScheduleError(f"torch compute action {text!r} has no micro-batch")
    return [Op(_KIND[kind], int(stage), int(mb))]


@dataclass(frozen=True)
class ImportedOrder:
    schedule: Schedule
    repaired_ranks: tuple[int, ...]  # ranks whose forwards were renumbered (single-stage 1F1B)


def _infer_placement(rows: Sequence[Sequence[Op]], p: int) -> Placement:
    where: dict[int, int] = {}
    for rank, row in enumerate(rows):
        for op in row:
            if where.setdefault(op.stage, rank) != rank:
                raise ScheduleError(f"torch order runs stage {op.stage} on ranks {where[op.stage]} and {rank}")
    num_stages = max(where) + 1 if where else p
    if set(where) != set(range(num_stages)):
        raise ScheduleError(f"torch order misses stages {sorted(set(range(num_stages)) - set(where))}")
    if num_stages % p:
        raise ScheduleError(f"torch order has {num_stages} stages on {p} ranks")
    loop = loop_placement(p, num_stages // p)
    if all(loop.rank_of(s) == r for s, r in where.items()):
        return loop
    if num_stages == 2 * p:
        vee = v_placement(p)
        if all(vee.rank_of(s) == r for s, r in where.items()):
            return vee
    raise ScheduleError("torch order's stage-to-rank map is neither looped (s % p) nor V (r, 2p-1-r)")


def _repair_single_stage(rows: list[list[Op]], m: int) -> tuple[int, ...]:
    repaired = []
    for rank, row in enumerate(rows):
        fwd = [op.microbatch for op in row if op.kind == OpKind.F]
        bwd = {op.microbatch for op in row if op.kind != OpKind.F}
        if sorted(fwd) == list(range(1, m + 1)) and bwd == set(range(m)):
            counter = iter(range(m))
            rows[rank] = [Op(op.kind, op.stage, next(counter)) if op.kind == OpKind.F else op for op in row]
            repaired.append(rank)
    return tuple(repaired)


def import_order(
    order: Sequence[Sequence[object]], m: int, name: str = "torch", *, overlap_pairs: bool = False
) -> ImportedOrder:
    """Our :class:`Schedule` for a torch ``pipeline_order`` given per rank (actions or their text);
    ``overlap_pairs``: keep each ``OVERLAP_F_B`` as an overlap pair of the schedule."""
    rows: list[list[Op]] = []
    pairs: list[list[int]] = []
    for row in order:
        ops: list[Op] = []
        starts: list[int] = []
        for action in row:
            text = None if action is None else str(action)
            parsed = parse_action(text)
            if parsed:
                if len(parsed) == 2 and _OVERLAP_RE.match(str(text).strip()):
                    starts.append(len(ops))
                ops.extend(parsed)
        rows.append(ops)
        pairs.append(starts)
    p = len(rows)
    placement = _infer_placement(rows, p)
    repaired = _repair_single_stage(rows, m) if placement.num_stages == p else ()
    schedule = build_schedule(name, placement, m, rows, source="torch.distributed.pipelining", repaired=repaired)
    if overlap_pairs and any(pairs):
        schedule = schedule.with_overlap_pairs(pairs)
    return ImportedOrder(schedule, repaired)


def torch_pipeline_order(short_name: str, p: int, m: int) -> list[list[str | None]]:
    """torch's own ``pipeline_order`` (compute actions, text form) for ``p`` ranks and ``m`` micro-batches.

    Imports torch (only here). Raises ``ValueError`` where torch refuses the shape (e.g. DualPipeV
    with m < 2p)."""
    import warnings

    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    info = TORCH_SCHEDULES.get(short_name)
    if info is None:
        raise ScheduleError(f"unknown torch schedule {short_name!r}; valid: {', '.join(TORCH_SCHEDULES)}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cls = getattr(schedules, info.torch_class)
        ops = get_schedule_ops(cls, p, m, num_stages_per_rank=info.stages_per_rank)
    return [[None if a is None else str(a) for a in row] for row in ops]


def import_torch_schedule(short_name: str, p: int, m: int) -> ImportedOrder:
    """torch's schedule ``short_name`` (a key of :data:`TORCH_SCHEDULES`) in our IR."""
    return import_order(torch_pipeline_order(short_name, p, m), m, name=f"torch:{short_name}")
