"""A plain, slow statement of the lowering algorithm (the oracle for ``lower()``'s array version).

1. Every op whose input another stage makes receives it: a local hand-off when producer and
   consumer share a rank, else a message sent right after the producer (gap ``index + 1``) and
   received right before the consumer (gap ``index``), or before its overlap pair when the consumer
   is the second op of one (gap ``index - 1``).
2. FIFO per channel: sorted by send gap, a receive is moved up to the next message's receive.
3. Rendezvous run (a batch completes once every peer has posted its side); whenever no rank can
   move, each blocked sender whose receiver has not reached the receive gets the receive moved into
   the receiver's current batch: one move per pair of ranks per round, activations first, then by
   rank.
"""

from __future__ import annotations

from megatron_pp_ext.schedules import Compute, Exchange, Message, Schedule
from megatron_pp_ext.schedules.lowering import ACT, GRAD, Instruction

Program = tuple[Instruction, ...]


def reference_programs(schedule: Schedule) -> tuple[tuple[Program, ...], list[Message]]:
    rows = schedule.ops
    last = schedule.placement.stages_per_replica - 1
    where = {}
    for rank, row in enumerate(rows):
        for i, op in enumerate(row):
            if op.kind != "W":
                where[(op.kind == "F", op.stage, op.microbatch)] = (rank, i)
    found: list[tuple[str, int, int, int, int, int, int, int]] = []  # kind, src/dst stage, mb, ranks, gaps
    second_of_pair = {(rank, i + 1) for rank, starts in enumerate(schedule.overlap_pairs) for i in starts}
    handoffs = []
    for rank, row in enumerate(rows):
        for i, op in enumerate(row):
            if op.kind == "W" or (op.kind == "F" and op.stage % (last + 1) == 0):
                continue
            if op.kind != "F" and op.stage % (last + 1) == last:
                continue
            kind, src_stage = (ACT, op.stage - 1) if op.kind == "F" else (GRAD, op.stage + 1)
            src_rank, src_index = where[(kind == ACT, src_stage, op.microbatch)]
            if src_rank == rank:
                handoffs.append(op)
                continue
            at = i - 1 if (rank, i) in second_of_pair else i
            found.append((kind, src_stage, op.stage, op.microbatch, src_rank, rank, src_index + 1, at))
    channels: dict[tuple[int, int], list[int]] = {}
    for mid, f in enumerate(found):
        channels.setdefault((f[4], f[5]), []).append(mid)
    send_gap = [f[6] for f in found]
    recv_gap = [f[7] for f in found]
    seq = [0] * len(found)
    for mids in channels.values():
        mids.sort(key=lambda mid: send_gap[mid])
        for n, mid in enumerate(mids):
            seq[mid] = n
        for a, b in zip(reversed(mids[:-1]), reversed(mids[1:]), strict=True):
            recv_gap[a] = min(recv_gap[a], recv_gap[b])
    messages = [Message(*f[:6], seq[mid]) for mid, f in enumerate(found)]
    _repair(len(rows), [len(row) for row in rows], messages, send_gap, recv_gap)
    programs = []
    for rank, row in enumerate(rows):
        program: list[Instruction] = []
        for gap in range(len(row) + 1):
            sends = sorted((m for mid, m in enumerate(messages) if m.src_rank == rank and send_gap[mid] == gap),
                           key=lambda m: (m.dst_rank, m.seq))  # fmt: skip
            recvs = sorted((m for mid, m in enumerate(messages) if m.dst_rank == rank and recv_gap[mid] == gap),
                           key=lambda m: (m.src_rank, m.seq))  # fmt: skip
            if sends or recvs:
                program.append(Exchange(tuple(sends), tuple(recvs)))
            if gap < len(row):
                program.append(Compute(row[gap]))
        programs.append(tuple(program))
    return tuple(programs), messages


def _repair(p: int, lengths: list[int], messages: list[Message], send_gap: list[int], recv_gap: list[int]) -> None:
    at = [0] * p  # gap each rank has posted; lengths[r] + 1 once finished

    def batch_done(rank: int) -> bool:
        for mid, m in enumerate(messages):
            if m.src_rank == rank and send_gap[mid] == at[rank] and at[m.dst_rank] < recv_gap[mid]:
                return False
            if m.dst_rank == rank and recv_gap[mid] == at[rank] and at[m.src_rank] < send_gap[mid]:
                return False
        return True

    while True:
        moved = True
        while moved:
            moved = False
            for rank in range(p):
                while at[rank] <= lengths[rank] and batch_done(rank):
                    at[rank] += 1
                    moved = True
        if all(at[r] > lengths[r] for r in range(p)):
            return
        candidates = sorted(
            (m.kind == GRAD, m.src_rank, m.dst_rank, mid)
            for mid, m in enumerate(messages)
            if at[m.src_rank] <= lengths[m.src_rank]
            and send_gap[mid] == at[m.src_rank]
            and at[m.dst_rank] < recv_gap[mid]
        )
        busy: set[int] = set()
        for _, src, dst, mid in candidates:
            if src not in busy and dst not in busy:
                recv_gap[mid] = at[dst]
                busy |= {src, dst}
        if not busy:
            return  # a real deadlock
