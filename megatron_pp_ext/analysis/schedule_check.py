"""Validate a schedule: placement, completeness, per-rank dependency order, deadlock freedom.

:func:`validate` runs the checks in this order and raises the first problem found as a
:class:`ScheduleValidationError` subclass whose message names the rank and the op:

1. :class:`PlacementError`: an op on a stage the placement lacks, on a rank other than the
   one the placement puts its stage on, with a micro-batch index out of range, or (two
   replicas) on a stage of the other replica than its micro-batch's.
2. :class:`DuplicateOpError` / :class:`MissingOpError`: every (stage, micro-batch) of each
   micro-batch's replica runs exactly one ``F`` and either one ``BW`` or one ``B`` and one ``W``.
3. :class:`DependencyError`: on one rank, ``F(s,m)`` after ``F(s-1,m)``, a backward of
   ``(s,m)`` after the backward of ``(s+1,m)`` and after ``F(s,m)``, ``W`` after its ``B``; each
   overlap pair one forward and one backward whose second op's input does not wait for the first.
4. :class:`DeadlockError`: the lowered program (see :mod:`megatron_pp_ext.schedules.lowering`)
   runs to the end under rendezvous semantics, and every channel receives in send order.
5. only when a :class:`~megatron_pp_ext.schedules.collectives.CollectivePolicy` is given,
   :class:`CollectiveError`: the derived data-parallel / FSDP / replica collectives pass
   :func:`~megatron_pp_ext.schedules.collectives.check_collectives` (every chunk reduced once
   after its last gradient op, gathered before every weight use within the limit, replica
   pairs in the same order).

All checks are linear in the number of ops.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import compress
from operator import le

import numpy as np

from ..schedules.collectives import CollectivePlan, CollectivePolicy, check_collectives, derive_collectives
from ..schedules.ir import Op, OpKind, ScheduleError
from ..schedules.lowering import GRAD, Compute, Exchange, LoweredSchedule, Message, lower
from ..schedules.op_arrays import KIND_BW, KIND_F, KIND_W, op_arrays
from ..schedules.pairs import blocked_pairs
from ..schedules.schedule import Schedule

__all__ = [
    "ChannelError",
    "CollectiveError",
    "DeadlockError",
    "DependencyError",
    "DuplicateOpError",
    "MissingOpError",
    "OpPositions",
    "PlacementError",
    "ScheduleValidationError",
    "check_collective_plan",
    "check_dependencies",
    "check_lowered",
    "check_ops",
    "validate",
]


class ScheduleValidationError(ScheduleError):
    """A schedule breaks a rule every schedule must obey."""


class PlacementError(ScheduleValidationError):
    """An op runs on a stage, rank or micro-batch the placement does not allow."""


class MissingOpError(ScheduleValidationError):
    """A (stage, micro-batch) lacks its F, or its backward (BW, or B and W)."""


class DuplicateOpError(ScheduleValidationError):
    """An op appears twice, or a (stage, micro-batch) mixes BW with B/W."""


class DependencyError(ScheduleValidationError):
    """On one rank an op runs before an op whose result it needs."""


class DeadlockError(ScheduleValidationError):
    """The lowered program cannot run to the end: some ranks wait for each other forever."""


class ChannelError(DeadlockError):
    """Sends and receives of a lowered program do not pair up (a message posted twice, on the
    wrong rank, or a channel whose receives are not in send order: NCCL pairs by order, so this
    would hand the wrong tensor over or hang)."""


class CollectiveError(ScheduleValidationError):
    """The collectives derived for a data-parallel set-up break a rule (see check_collectives)."""


_INF = 1 << 62  # "no W" position of a BW cell: any B position is smaller
_KIND_F, _KIND_B, _KIND_W, _KIND_BW = OpKind.F, OpKind.B, OpKind.W, OpKind.BW


class OpPositions:
    """Where each op runs on its rank (its index in the rank's op list), by cell ``stage * m + microbatch``."""

    __slots__ = ("b", "bw", "f", "m", "w")

    def __init__(self, cells: int, m: int) -> None:
        self.m = m
        self.f = [-2] * cells
        self.b = [-1] * cells  # position of the backward that makes the input gradient: B or BW
        self.w = [_INF] * cells  # position of W; _INF when the cell has none (BW, or unused)
        self.bw = bytearray(cells)  # 1 where the backward is a BW


# ---- 1 + 2: placement and completeness -------------------------------------------------------
def check_ops(schedule: Schedule) -> OpPositions:
    """Placement, micro-batch range and completeness checks; returns the op position index."""
    pos = _positions_if_well_placed(schedule)
    if pos is None:  # something is off: find and report it op by op
        pos = _check_ops_one_by_one(schedule)
    _check_complete(schedule, pos)
    return pos


def _positions_if_well_placed(schedule: Schedule) -> OpPositions | None:
    """The position index, computed on whole arrays, or None if any op is misplaced or duplicated."""
    try:
        arrays = op_arrays(schedule)
    except (ScheduleError, TypeError, ValueError, OverflowError):
        return None
    placement = schedule.placement
    num_stages, m = placement.num_stages, schedule.num_microbatches
    kind, stage, mb = arrays.kind, arrays.stage, arrays.microbatch
    if arrays.total and not (
        0 <= int(stage.min()) and int(stage.max()) < num_stages and 0 <= int(mb.min()) and int(mb.max()) < m
    ):
        return None
    stage_rank = np.asarray([loc[0] for loc in placement.locations], dtype=np.int64)
    if not np.array_equal(stage_rank[stage], arrays.rank):
        return None
    if placement.num_replicas > 1 or schedule.microbatch_replicas:
        if any(not 0 <= rep < placement.num_replicas for rep in schedule.microbatch_replicas):
            return None
        stage_replica = np.asarray([placement.replica_of(s) for s in range(num_stages)], dtype=np.int64)
        mb_replica = np.asarray([schedule.replica_of_microbatch(b) for b in range(m)], dtype=np.int64)
        if not np.array_equal(stage_replica[stage], mb_replica[mb]):
            return None
    cells = num_stages * m
    cell = stage * m + mb
    pos = OpPositions(cells, m)
    is_f, is_w = kind == KIND_F, kind == KIND_W
    is_back = ~(is_f | is_w)
    for selected, target, empty in ((is_f, "f", -2), (is_back, "b", -1), (is_w, "w", _INF)):
        where = cell[selected]
        if len(where) and int(np.bincount(where, minlength=cells).max()) > 1:
            return None  # a duplicate
        column = np.full(cells, empty, dtype=np.int64)
        column[where] = arrays.index[selected]
        setattr(pos, target, column.tolist())
    bw = np.zeros(cells, dtype=np.uint8)
    bw[cell[kind == KIND_BW]] = 1
    pos.bw = bytearray(bw.tobytes())
    return pos


def _check_ops_one_by_one(schedule: Schedule) -> OpPositions:
    placement = schedule.placement
    num_stages = placement.num_stages
    m = schedule.num_microbatches
    stage_rank = [loc[0] for loc in placement.locations]
    replicas = schedule.microbatch_replicas
    two_way = placement.num_replicas > 1 or bool(replicas)
    stage_replica = [placement.replica_of(stage) for stage in range(num_stages)]
    mb_replica = [schedule.replica_of_microbatch(mb) for mb in range(m)] if two_way else []
    if replicas:
        for mb, rep in enumerate(replicas):
            if not 0 <= rep < placement.num_replicas:
                raise PlacementError(
                    f"micro-batch {mb} is assigned to replica {rep}, but the placement has "
                    f"{placement.num_replicas} replica(s)"
                )
    pos = OpPositions(num_stages * m, m)
    f, b, w, bw = pos.f, pos.b, pos.w, pos.bw
    duplicate: tuple[int, Op, int, int] | None = None
    for rank, row in enumerate(schedule.ops):
        for i, op in enumerate(row):
            stage, mb, kind = op.stage, op.microbatch, op.kind
            if not (0 <= stage < num_stages and stage_rank[stage] == rank and 0 <= mb < m and type(kind) is OpKind):
                _raise_bad_op(schedule, rank, op)
            if two_way and stage_replica[stage] != mb_replica[mb]:
                own = schedule.stages_of_microbatch(mb)
                raise PlacementError(
                    f"rank {rank}: {op} runs stage {stage} of replica {placement.replica_of(stage)}, but "
                    f"micro-batch {mb} belongs to replica {schedule.replica_of_microbatch(mb)} "
                    f"(stages {own.start}..{own.stop - 1})"
                )
            if duplicate is not None:
                continue
            cell = stage * m + mb
            if kind is _KIND_F:
                if f[cell] >= 0:
                    duplicate = (rank, op, f[cell], i)
                f[cell] = i
            elif kind is _KIND_W:
                if w[cell] != _INF:
                    duplicate = (rank, op, w[cell], i)
                w[cell] = i
            else:
                if b[cell] >= 0:
                    duplicate = (rank, op, b[cell], i)
                b[cell] = i
                if kind is _KIND_BW:
                    bw[cell] = 1
    if duplicate is not None:
        _raise_duplicate(schedule, *duplicate)
    return pos


def _raise_bad_op(schedule: Schedule, rank: int, op: Op) -> None:
    placement = schedule.placement
    stage, mb, kind = op.stage, op.microbatch, op.kind
    num_stages, m = placement.num_stages, schedule.num_microbatches
    if type(kind) is not OpKind:
        raise ScheduleValidationError(
            f"rank {rank}: op {tuple(op)!r} has kind {kind!r}, not an OpKind (build ops with Op.parse or F/B/W/BW)"
        )
    if not 0 <= stage < num_stages:
        raise PlacementError(
            f"rank {rank}: {op} is on stage {stage}, which the {placement.style} placement does not have "
            f"(stages 0..{num_stages - 1})"
        )
    if placement.rank_of(stage) != rank:
        raise PlacementError(
            f"rank {rank}: {op} runs stage {stage}, which the {placement.style} placement puts on "
            f"rank {placement.rank_of(stage)}"
        )
    raise PlacementError(
        f"rank {rank}: {op} uses micro-batch {mb}, but the schedule has {m} micro-batches (0..{m - 1})"
    )


def _raise_duplicate(schedule: Schedule, rank: int, op: Op, first: int, second: int) -> None:
    other = schedule.ops[rank][first]
    if other == op:
        raise DuplicateOpError(f"rank {rank}: {op} appears twice (positions {first} and {second})")
    raise DuplicateOpError(
        f"rank {rank}: {other} (position {first}) and {op} (position {second}) both run: a (stage, "
        "micro-batch) runs either one BW or one B and one W"
    )


def _check_complete(schedule: Schedule, pos: OpPositions) -> None:
    placement = schedule.placement
    m = pos.m
    per_replica = placement.stages_per_replica
    cells = per_replica * m  # every micro-batch runs every stage of its own replica
    n_f = len(pos.f) - pos.f.count(-2)
    n_bw = pos.bw.count(1)
    n_b = len(pos.b) - pos.b.count(-1) - n_bw
    n_w = len(pos.w) - pos.w.count(_INF)
    # No cell holds an op twice; so these counts are exact iff every cell is complete and unmixed.
    if n_f == cells and n_bw + n_b == cells and n_b == n_w and _no_mixing(pos):
        return
    for mb in range(m):
        for stage in schedule.stages_of_microbatch(mb):
            _check_cell(schedule, pos, stage, mb)
    raise AssertionError("completeness counts disagree with the per-cell check")  # pragma: no cover


def _no_mixing(pos: OpPositions) -> bool:
    # A BW cell must have no W; W positions of BW cells would be set.
    return all(w == _INF for w in compress(pos.w, pos.bw))


def _check_cell(schedule: Schedule, pos: OpPositions, stage: int, mb: int) -> None:
    rank = schedule.placement.rank_of(stage)
    cell = stage * pos.m + mb
    f, b, w, is_bw = pos.f[cell], pos.b[cell], pos.w[cell], pos.bw[cell]
    replica = schedule.replica_of_microbatch(mb)
    if f < 0:
        raise MissingOpError(
            f"rank {rank}: F{stage}.{mb} is missing: micro-batch {mb} runs forward through every stage of "
            f"replica {replica}"
        )
    if is_bw and w != _INF:
        raise DuplicateOpError(
            f"rank {rank}: BW{stage}.{mb} (position {b}) and W{stage}.{mb} (position {w}) both run: a (stage, "
            "micro-batch) runs either one BW or one B and one W"
        )
    if b < 0 and w == _INF:
        raise MissingOpError(
            f"rank {rank}: no backward for stage {stage} micro-batch {mb}: expected BW{stage}.{mb}, or "
            f"B{stage}.{mb} and W{stage}.{mb}"
        )
    if b < 0:
        raise MissingOpError(f"rank {rank}: B{stage}.{mb} is missing (W{stage}.{mb} runs at position {w})")
    if not is_bw and w == _INF:
        raise MissingOpError(f"rank {rank}: W{stage}.{mb} is missing (B{stage}.{mb} runs at position {b})")


# ---- 3: per-rank dependency order -----------------------------------------------------------
def check_dependencies(schedule: Schedule, pos: OpPositions | None = None) -> None:
    """Same-rank dependency order (runs :func:`check_ops` first unless given its result)."""
    if pos is None:
        pos = check_ops(schedule)
    placement = schedule.placement
    m = pos.m
    f, b, w = pos.f, pos.b, pos.w
    # Unused cells hold f=-2, b=-1, w=_INF, so every comparison below holds for them; ops of one
    # rank have distinct positions, so "<=" between two used cells on one rank means "<".
    ok = all(map(le, f, b)) and all(map(le, b, w))
    if ok:
        for stage in range(placement.num_stages):
            nxt = placement.next_stage(stage)
            if nxt is None or placement.rank_of(nxt) != placement.rank_of(stage):
                continue
            lo, hi = stage * m, nxt * m
            if not (all(map(le, f[lo:hi], f[hi : hi + m])) and all(map(le, b[hi : hi + m], b[lo:hi]))):
                ok = False
                break
    if not ok:
        _raise_dependency(schedule, pos)


def _raise_dependency(schedule: Schedule, pos: OpPositions) -> None:
    """Slow path: report the first violation, lowest rank first, then earliest position."""
    placement = schedule.placement
    m = pos.m
    for rank, row in enumerate(schedule.ops):
        for i, op in enumerate(row):
            kind, stage, mb = op.kind, op.stage, op.microbatch
            cell = stage * m + mb
            needs: list[tuple[int, str]] = []
            if kind is _KIND_F:
                prev = placement.prev_stage(stage)
                if prev is not None and placement.rank_of(prev) == rank:
                    needs.append((pos.f[cell - m], f"F{prev}.{mb}, whose output it needs"))
            elif kind is _KIND_W:
                needs.append((pos.b[cell], f"its B{stage}.{mb}"))
            else:
                needs.append((pos.f[cell], f"its F{stage}.{mb}"))
                nxt = placement.next_stage(stage)
                if nxt is not None and placement.rank_of(nxt) == rank:
                    producer = row[pos.b[cell + m]]
                    needs.append((pos.b[cell + m], f"{producer}, whose input gradient it needs"))
            for at, what in needs:
                if at > i:
                    raise DependencyError(f"rank {rank}: {op} runs before {what} (position {i} < {at})")
    raise AssertionError("dependency check failed but no violation found")  # pragma: no cover


# ---- 4: the lowered program -----------------------------------------------------------------
def _message_id(msg: Message, num_stages: int, m: int) -> int:
    if not (0 <= msg.dst_stage < num_stages and 0 <= msg.microbatch < m):
        raise ChannelError(f"message {msg} names a stage or micro-batch outside the schedule")
    return ((msg.dst_stage * m + msg.microbatch) << 1) | (msg.kind == GRAD)


def check_lowered(lowered: LoweredSchedule) -> None:
    """Deadlock freedom and per-channel FIFO order of a lowered program.

    Semantics: each rank runs its program in order. A :class:`Compute` runs at once. An
    :class:`Exchange` is posted as a whole and completes once each of its messages is matched:
    a send once the receiving rank has reached (is at or past) the exchange holding the
    receive, a receive once the sending rank has reached the exchange holding the send.
    Long because the matching of exchanges is one loop over the ranks' positions whose state reads best together.
    """
    if lowered.plan is not None:
        # Made by lower(): its channels are FIFO by construction and its repair pass ran the
        # program under exactly these semantics; a program that still deadlocks (a cycle in the
        # data dependencies) is re-run below over its instructions for the report.
        if lowered.plan.stuck_at is None:
            return
    schedule = lowered.schedule
    p = schedule.num_ranks
    m = schedule.num_microbatches
    num_stages = schedule.num_stages
    programs = lowered.programs
    n_ids = 2 * num_stages * m
    sender_at = bytearray(n_ids)  # 1 once the sending rank reached the exchange with the send
    receiver_at = bytearray(n_ids)  # 1 once the receiving rank reached the exchange with the recv
    # [src][dst] -> message ids in send order; [dst][src] -> message ids in receive order
    chan_sends: list[list[list[int]]] = [[[] for _ in range(p)] for _ in range(p)]
    chan_recvs: list[list[list[int]]] = [[[] for _ in range(p)] for _ in range(p)]
    pc = [0] * p
    # Whoever posts its side of a message first waits for the other side; the second poster
    # counts the first one's wait down and resumes it when nothing is left.
    outstanding = [0] * p
    blocked = bytearray(p)
    stack = list(range(p - 1, -1, -1))
    while stack:
        rank = stack.pop()
        program = programs[rank]
        n = len(program)
        k = pc[rank]
        my_sends, my_recvs = chan_sends[rank], chan_recvs[rank]
        if blocked[rank]:  # resumed: its exchange is complete
            blocked[rank] = 0
            k += 1
        while k < n:
            ins = program[k]
            if type(ins) is Compute:
                k += 1
                continue
            waits = 0
            sides = (
                (ins.sends, "send", sender_at, receiver_at, my_sends),
                (ins.recvs, "receive", receiver_at, sender_at, my_recvs),
            )
            for msgs, what, mine, theirs, channel in sides:
                for msg in msgs:
                    owner, peer = (msg.src_rank, msg.dst_rank) if what == "send" else (msg.dst_rank, msg.src_rank)
                    stage, mb = msg.dst_stage, msg.microbatch
                    if not (0 <= stage < num_stages and 0 <= mb < m) or owner != rank:
                        _raise_bad_post(rank, msg, what, owner)
                    mid = ((stage * m + mb) << 1) | (msg.kind == GRAD)
                    if mine[mid]:
                        _raise_bad_post(rank, msg, what, rank)
                    mine[mid] = 1
                    channel[peer].append(mid)
                    if not theirs[mid]:
                        waits += 1
                    else:
                        outstanding[peer] -= 1
                        if not outstanding[peer]:
                            stack.append(peer)
            if waits:
                outstanding[rank] = waits
                blocked[rank] = 1
                break
            k += 1
        pc[rank] = k
    if any(pc[r] < len(programs[r]) for r in range(p)):
        raise DeadlockError(_deadlock_report(lowered, pc, sender_at, receiver_at))
    for src in range(p):
        for dst in range(p):
            if chan_sends[src][dst] != chan_recvs[dst][src]:
                _raise_channel_order(lowered, src, dst)
    posted = sum(len(row) for sends in chan_sends for row in sends)
    if posted != len(lowered.messages):
        raise ChannelError(f"the lowering lists {len(lowered.messages)} messages but its programs send {posted}")


def _raise_bad_post(rank: int, msg: Message, what: str, owner: int) -> None:
    if owner != rank:
        raise ChannelError(f"rank {rank}: posts the {what} of {msg}, which belongs to rank {owner}")
    raise ChannelError(f"rank {rank}: posts the {what} of {msg} twice")


def _raise_channel_order(lowered: LoweredSchedule, src: int, dst: int) -> None:
    sends = [msg for ins in lowered.programs[src] if type(ins) is Exchange for msg in ins.sends if msg.dst_rank == dst]
    recvs = [msg for ins in lowered.programs[dst] if type(ins) is Exchange for msg in ins.recvs if msg.src_rank == src]
    for i, (s, r) in enumerate(zip(sends, recvs, strict=False)):
        if s.key != r.key:
            raise ChannelError(
                f"rank {dst}: receive #{i} on channel rank {src} -> rank {dst} is {r}, but rank {src}'s send #{i} "
                f"is {s}: receives must follow the send order"
            )
    raise ChannelError(f"channel rank {src} -> rank {dst}: {len(sends)} sends but {len(recvs)} receives")


# ---- deadlock report ------------------------------------------------------------------------
EXCERPT_OPS = 3  # ops shown on each side of a stuck position


def _next_compute(program: Sequence[object], k: int) -> int:
    """Index among the rank's compute ops of the first compute at or after instruction ``k``."""
    return sum(1 for ins in program[:k] if type(ins) is Compute)


def _where(lowered: LoweredSchedule, rank: int, k: int) -> str:
    """Where exchange ``k`` of ``rank`` sits: ``in the exchange before F1.2 (position 6)``."""
    program = lowered.programs[rank]
    ops = lowered.schedule.ops[rank]
    idx = _next_compute(program, k)
    lo = hi = k
    while lo > 0 and type(program[lo - 1]) is not Compute:
        lo -= 1
    while hi + 1 < len(program) and type(program[hi + 1]) is not Compute:
        hi += 1
    which = "the exchange" if lo == hi else f"exchange {k - lo + 1} of {hi - lo + 1}"
    return f"in {which} before {ops[idx]} (position {idx})" if idx < len(ops) else f"in {which} after its last op"


def _locate(lowered: LoweredSchedule) -> tuple[dict[tuple[str, int, int], int], dict[tuple[str, int, int], int]]:
    """Instruction index of the exchange that sends / receives each message."""
    send_at: dict[tuple[str, int, int], int] = {}
    recv_at: dict[tuple[str, int, int], int] = {}
    for program in lowered.programs:
        for k, ins in enumerate(program):
            if type(ins) is Exchange:
                for msg in ins.sends:
                    send_at[msg.key] = k
                for msg in ins.recvs:
                    recv_at[msg.key] = k
    return send_at, recv_at


MAX_REPORTED_RANKS = 8  # stuck ranks described in detail in a deadlock report


def _deadlock_report(lowered: LoweredSchedule, pc: list[int], sender_at: bytearray, receiver_at: bytearray) -> str:
    schedule = lowered.schedule
    m, num_stages = schedule.num_microbatches, schedule.num_stages
    stuck = [r for r in range(schedule.num_ranks) if pc[r] < len(lowered.programs[r])]
    send_at, recv_at = _locate(lowered)
    details: dict[int, list[str]] = {}
    waits_for: dict[int, int] = {}  # stuck rank -> the peer of its first unmatched message
    for rank in stuck:
        ins = lowered.programs[rank][pc[rank]]
        assert isinstance(ins, Exchange)
        lines = [f"  rank {rank}: waits {_where(lowered, rank, pc[rank])}; unmatched:"]
        sides = [("send", msg, msg.dst_rank, recv_at, receiver_at, "receive") for msg in ins.sends]
        sides += [("recv", msg, msg.src_rank, send_at, sender_at, "send") for msg in ins.recvs]
        for what, msg, peer, peer_at, matched, other in sides:
            if matched[_message_id(msg, num_stages, m)]:
                continue
            waits_for.setdefault(rank, peer)
            at = peer_at.get(msg.key)
            why = (
                f"rank {peer} posts no matching {other}"
                if at is None
                else f"rank {peer} posts the {other} {_where(lowered, peer, at)} but is stuck "
                f"{_where(lowered, peer, pc[peer])}"
            )
            lines.append(f"    {what} {msg}: {why}")
        details[rank] = lines
    cycle = _wait_cycle(stuck[0], waits_for)
    shown = (cycle + [r for r in stuck if r not in cycle])[:MAX_REPORTED_RANKS]
    out = [f"deadlock: no rank can advance; {len(stuck)} rank(s) stuck"]
    if len(cycle) > 1:
        ring = " -> ".join(f"rank {r}" for r in [*cycle[:MAX_REPORTED_RANKS], cycle[0]])
        if len(cycle) > MAX_REPORTED_RANKS:
            ring = " -> ".join(f"rank {r}" for r in cycle[:MAX_REPORTED_RANKS]) + f" -> ... ({len(cycle)} ranks)"
        out.append(f"wait cycle: {ring}")
    for rank in shown:
        out.extend(details[rank])
    if len(stuck) > len(shown):
        rest = [r for r in stuck if r not in shown]
        more = ", ".join(map(str, rest[:16])) + (", ..." if len(rest) > 16 else "")
        out.append(f"  ... and {len(rest)} more stuck rank(s): {more}")
    out.append("schedule around the stuck positions (>>op<< = the op the rank cannot reach):")
    for rank in shown:
        out.append("  " + excerpt(schedule, rank, _next_compute(lowered.programs[rank], pc[rank])))
    return "\n".join(out)


def _wait_cycle(start: int, waits_for: dict[int, int]) -> list[int]:
    """Ranks on the wait-for cycle reached from ``start`` (empty when the chain ends)."""
    seen: dict[int, int] = {}
    path: list[int] = []
    rank: int | None = start
    while rank is not None and rank not in seen:
        seen[rank] = len(path)
        path.append(rank)
        rank = waits_for.get(rank)
    return [] if rank is None else path[seen[rank] :]


def excerpt(schedule: Schedule, rank: int, index: int, width: int = EXCERPT_OPS) -> str:
    """``rank r: ... a b >>c<< d e ...`` with op ``index`` of the rank marked."""
    ops = schedule.ops[rank]
    lo, hi = max(0, index - width), min(len(ops), index + width + 1)
    cells = [f">>{op}<<" if lo + j == index else str(op) for j, op in enumerate(ops[lo:hi])]
    if index >= len(ops):
        cells.append(">>end<<")
    head = "... " if lo > 0 else ""
    tail = " ..." if hi < len(ops) else ""
    return f"rank {rank}: {head}{' '.join(cells)}{tail}"


def check_overlap_pairs(schedule: Schedule) -> None:
    """Each overlap pair is one forward and one backward (``B``/``BW``) of different (stage, micro-batch):
    neither needs the other's output, so the executor may run them together."""
    for rank, starts in enumerate(schedule.overlap_pairs):
        for i in starts:
            first, second = schedule.ops[rank][i : i + 2]
            kinds = {first.kind, second.kind}
            if OpKind.F not in kinds or not (kinds & {OpKind.B, OpKind.BW}) or first[1:] == second[1:]:
                raise DependencyError(
                    f"rank {rank}: overlap pair {first}+{second} at op {i} must be one forward and one backward "
                    f"(B or BW) of different stages or micro-batches\n{excerpt(schedule, rank, i)}"
                )
    if schedule.overlap_pairs:
        _check_pairs_independent(schedule)


def _check_pairs_independent(schedule: Schedule) -> None:
    """The input of a pair's second op can arrive before the pair (the lowering receives it there):
    it must not be made by an op that waits for the pair's first op (:mod:`~..schedules.pairs`)."""
    try:
        blocked = blocked_pairs(schedule)
    except ValueError as exc:
        raise DependencyError(str(exc)) from None
    for rank, i in blocked[:1]:
        first, second = schedule.ops[rank][i : i + 2]
        raise DependencyError(
            f"rank {rank}: overlap pair {first}+{second} at op {i}: the input of {second} waits for "
            f"{first}, so it cannot arrive before the pair\n{excerpt(schedule, rank, i)}"
        )


# ---- all together ---------------------------------------------------------------------------
def check_collective_plan(schedule: Schedule, policy: CollectivePolicy) -> CollectivePlan:
    """Derive the collectives ``policy`` asks for and check them; :class:`CollectiveError` if not."""
    try:
        plan = derive_collectives(schedule, policy)
        check_collectives(plan)
    except ScheduleValidationError:
        raise
    except ScheduleError as exc:
        raise CollectiveError(str(exc)) from None
    return plan


def validate(schedule: Schedule, collectives: CollectivePolicy | None = None) -> LoweredSchedule:
    """Check ``schedule`` (see the module doc); return its lowering, or raise the first problem.
    With ``collectives``, the collectives derived for that policy are checked too."""
    pos = check_ops(schedule)
    check_dependencies(schedule, pos)
    check_overlap_pairs(schedule)
    lowered = lower(schedule)
    check_lowered(lowered)
    if collectives is not None:
        check_collective_plan(schedule, collectives)
    return lowered
