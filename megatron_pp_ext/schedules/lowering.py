"""Lowering: derive every rank's communication from a schedule's compute ops.

This is the only place communication is decided; the executor and the
simulator both read its output.

Data that flows between stages:

* ``act``: the output of ``F(s, m)``, consumed by ``F(s+1, m)``;
* ``grad``: the input gradient made by ``B(s, m)`` or ``BW(s, m)``, consumed by the
  backward (``B`` or ``BW``) of ``(s-1, m)``.

When producer and consumer stages sit on the same rank the data is handed over
locally (no message). Otherwise the producer's rank sends it right after the
producer op and the consumer's rank posts the receive ``PREFETCH_OPS`` (one) op
before the consumer op (prefetch: the message can land while the op before the
consumer runs, and a sender's transfer is matched sooner); only the consumer waits
for it (:mod:`megatron_pp_ext.runtime.channels`). Where prefetching would make the
programs deadlock under rendezvous semantics (below), every receive sits just before
its consumer instead. Between two compute ops a rank posts what it sends and receives
there as one :class:`Exchange`. On every channel ``(src_rank, dst_rank)`` the receiver posts receives
in exactly the order the sender posts sends (FIFO), moving a receive earlier
when its consumer runs out of order; with NCCL, which ignores tags, this is what
keeps same-shaped activations and gradients between the same two peers from
being swapped (the PP=2 trap). Each message also carries its sequence number on
the channel, usable as a tag on backends that honour tags (gloo).

Where a receive just before its consumer would close a wait-for cycle under
rendezvous semantics, it moves earlier (:mod:`.rendezvous`). The decisions are kept
as integer arrays (:class:`CommPlan`); the per-rank programs of :class:`Compute` and
:class:`Exchange` instructions are built from them when first read.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import accumulate
from typing import NamedTuple, Union, final

import numpy as np

from .gc_pause import cyclic_gc_paused
from .ir import Op, ScheduleError
from .op_arrays import KIND_B, KIND_BW, KIND_F, OpArrays, op_arrays
from .progress import run_posted
from .rendezvous import events_by_rank, run_rendezvous
from .schedule import Schedule

ACT = "act"
GRAD = "grad"

#: How many ops before its consumer a receive is posted (prefetch; module doc).
PREFETCH_OPS = 1


class Message(NamedTuple):
    """One tensor moved between two stages for one micro-batch."""

    kind: str  # ACT or GRAD
    src_stage: int
    dst_stage: int
    microbatch: int
    src_rank: int
    dst_rank: int
    seq: int = 0  # position on its channel (src_rank -> dst_rank) within one iteration

    @property
    def key(self) -> tuple[str, int, int]:
        """Mailbox key under which the consumer finds this tensor."""
        return (self.kind, self.dst_stage, self.microbatch)

    @property
    def local(self) -> bool:
        return self.src_rank == self.dst_rank

    def __str__(self) -> str:
        return f"{self.kind}[{self.src_stage}->{self.dst_stage} mb{self.microbatch} r{self.src_rank}->r{self.dst_rank}]"


@final
class Compute(NamedTuple):
    op: Op

    def __str__(self) -> str:
        return str(self.op)


@final
class Exchange(NamedTuple):
    """The sends and receives a rank posts between two compute ops; each one completes on its own."""

    sends: tuple[Message, ...]
    recvs: tuple[Message, ...]

    def __str__(self) -> str:
        parts = [f"send {m}" for m in self.sends] + [f"recv {m}" for m in self.recvs]
        return "{" + "; ".join(parts) + "}"


Instruction = Union[Compute, Exchange]


@dataclass(frozen=True, eq=False)
class CommPlan:
    """What the lowering decided, as parallel integer lists indexed by message id.

    Message ids follow channel order (sender rank, receiver rank, then position on the channel).
    ``send_gap`` / ``recv_gap``: where the message is sent / received on its rank (gap ``i`` is
    just before op ``i``; a send sits right after its producer, a receive before its consumer or
    earlier: positions that run to the end under rendezvous semantics). ``post_gap``: where a
    backend whose transfers progress on their own posts the receive instead (``PREFETCH_OPS``
    earlier; never later than ``recv_gap``). ``consumer``: index of the op that consumes it on the
    receiving rank.
    ``stuck_at``: ``None`` when the program runs to the end under rendezvous semantics, else the
    gap every rank reached (see :mod:`.rendezvous`).
    """

    offsets: tuple[int, ...]  # global id of each rank's first op (see OpArrays)
    kind_grad: list[int]  # 1 for GRAD, 0 for ACT
    src_stage: list[int]
    dst_stage: list[int]
    microbatch: list[int]
    src_rank: list[int]
    dst_rank: list[int]
    seq: list[int]
    send_gap: list[int]
    recv_gap: list[int]
    post_gap: list[int]  # where a backend whose transfers progress on their own posts the receive
    consumer: list[int]
    handoffs: tuple[list[int], list[int], list[int], list[int], list[int]]  # kind_grad, src/dst stage, mb, rank
    stuck_at: tuple[int, ...] | None

    @property
    def num_messages(self) -> int:
        return len(self.kind_grad)

    @property
    def num_ranks(self) -> int:
        return len(self.offsets) - 1

    def _per_rank(self, fill: object) -> list[list[object]]:
        return [[fill] * (self.offsets[r + 1] - self.offsets[r]) for r in range(self.num_ranks)]

    def _per_op(self, ranks: list[int], indices: list[int]) -> list[list[int]]:
        """Per rank, per op: the id of the message at op ``indices[mid]`` of rank ``ranks[mid]``
        (none where the index is negative), else -1."""
        flat = np.full(self.offsets[-1], -1, dtype=np.int64)
        where = np.asarray(indices, dtype=np.int64)
        keep = where >= 0
        flat[np.asarray(self.offsets, dtype=np.int64)[np.asarray(ranks, dtype=np.int64)[keep]] + where[keep]] = (
            np.arange(self.num_messages)[keep]
        )
        return [flat[self.offsets[r] : self.offsets[r + 1]].tolist() for r in range(self.num_ranks)]

    @cached_property
    def sends_after_ops(self) -> list[list[int]]:
        """Per rank, per op: the message sent right after it, or -1 (an op produces at most one)."""
        return self._per_op(self.src_rank, [gap - 1 for gap in self.send_gap])

    @cached_property
    def inputs_of_ops(self) -> list[list[int]]:
        """Per rank, per op: the message that brings its input from another rank, or -1."""
        return self._per_op(self.dst_rank, self.consumer)

    @cached_property
    def receive_groups(self) -> list[list[tuple[int, ...] | None]]:
        """Per rank, per op: the messages received in the batch just before it (by sender, then
        channel order), or None."""
        return self._groups(self.recv_gap)

    @cached_property
    def prefetch_groups(self) -> list[list[tuple[int, ...] | None]]:
        """:attr:`receive_groups` at the prefetch positions (``post_gap``)."""
        return self._groups(self.post_gap)

    @cached_property
    def receive_buffers(self) -> list[list[list[int]]]:
        """Per rank, per op: message ids whose receive buffer is allocated and not yet handed to its
        consumer when the op ends (posted at ``post_gap``, taken by the consumer; what prefetching
        adds to a rank's memory)."""
        rows: list[list[list[int]]] = [[[] for _ in row] for row in self._per_rank(None)]
        for mid, (rank, gap, at) in enumerate(zip(self.dst_rank, self.post_gap, self.consumer, strict=True)):
            for k in range(gap, at):
                rows[rank][k].append(mid)
        return rows

    def receive_buffer_peaks(self) -> list[int]:
        """Per rank, the most receive buffers of :attr:`receive_buffers` held at the end of one op, counted
        without listing them per op (a planner sizes thousands of schedules and keeps none of those lists)."""
        deltas = [[0] * (self.offsets[r + 1] - self.offsets[r] + 1) for r in range(self.num_ranks)]
        for rank, gap, at in zip(self.dst_rank, self.post_gap, self.consumer, strict=True):
            if gap < at:
                deltas[rank][gap] += 1
                deltas[rank][at] -= 1
        peaks = []
        for row in deltas:
            held = peak = 0
            for step in row[:-1]:
                held += step
                peak = max(peak, held)
            peaks.append(peak)
        return peaks

    def _groups(self, gaps: list[int]) -> list[list[tuple[int, ...] | None]]:
        groups: list[dict[int, list[int]]] = [{} for _ in range(self.num_ranks)]
        for mid, (rank, gap) in enumerate(zip(self.dst_rank, gaps, strict=True)):
            if gap >= 0:
                groups[rank].setdefault(gap, []).append(mid)
        rows = self._per_rank(None)
        for rank, by_gap in enumerate(groups):
            for gap, mids in by_gap.items():
                rows[rank][gap] = tuple(mids)
        return rows  # type: ignore[return-value]

    @classmethod
    def from_programs(cls, schedule: Schedule, programs: tuple[tuple[Instruction, ...], ...]) -> CommPlan:
        """The plan a hand-made lowering amounts to, for timing it (not checked: ``stuck_at`` is
        None; :func:`~megatron_pp_ext.analysis.schedule_check.check_lowered` checks such programs). At
        most one send per op is kept; a consumer waits for its input only when the receive is
        posted before it."""
        ids: dict[tuple[str, int, int], int] = {}
        fields: list[list[int]] = []  # per id: grad, src/dst stage, mb, src/dst rank, seq, send/recv gap
        for program in programs:
            gap = 0
            for ins in program:
                if isinstance(ins, Compute):
                    gap += 1
                    continue
                for msg, column in [(msg, 7) for msg in ins.sends] + [(msg, 8) for msg in ins.recvs]:
                    mid = ids.setdefault(msg.key, len(ids))
                    if mid == len(fields):
                        fields.append([int(msg.kind == GRAD), msg.src_stage, msg.dst_stage, msg.microbatch])
                        fields[mid] += [msg.src_rank, msg.dst_rank, msg.seq, -1, -1]
                    fields[mid][column] = gap
        consumer_at = [
            {(op.kind != "F", op.stage, op.microbatch): i for i, op in enumerate(row) if op.kind != "W"}
            for row in schedule.ops
        ]
        consumer = []
        for grad, _, dst_stage, mb, _, dst_rank, _, _, recv_gap in fields:
            at = consumer_at[dst_rank].get((bool(grad), dst_stage, mb), -1) if 0 <= dst_rank < len(programs) else -1
            consumer.append(at if recv_gap >= 0 and at >= recv_gap else -1)
        columns = [list(column) for column in zip(*fields, strict=True)] if fields else [[] for _ in range(9)]
        lengths = [sum(1 for ins in program if isinstance(ins, Compute)) for program in programs]
        offsets = (0, *accumulate(lengths))
        kind_grad, src_stages, dst_stages, mbs, src_ranks, dst_ranks, seqs, send_gaps, recv_gaps = columns
        return cls(
            offsets, kind_grad, src_stages, dst_stages, mbs, src_ranks, dst_ranks, seqs, send_gaps, recv_gaps,
            list(recv_gaps), consumer, ([], [], [], [], []), None,
        )  # fmt: skip

    def message(self, mid: int) -> Message:
        return Message(
            GRAD if self.kind_grad[mid] else ACT,
            self.src_stage[mid],
            self.dst_stage[mid],
            self.microbatch[mid],
            self.src_rank[mid],
            self.dst_rank[mid],
            self.seq[mid],
        )


class LoweredSchedule:
    """A schedule with its communication: per rank a program of :class:`Compute` and
    :class:`Exchange` instructions.

    Made by :func:`lower` (from a :class:`CommPlan`; programs and message objects are built when
    first read) or by hand from ``programs``, ``messages`` and ``local_handoffs`` (tests,
    experiments: :func:`~megatron_pp_ext.analysis.schedule_check.check_lowered` checks those).
    """

    def __init__(
        self,
        schedule: Schedule,
        programs: tuple[tuple[Instruction, ...], ...] | None = None,
        messages: tuple[Message, ...] | None = None,
        local_handoffs: tuple[Message, ...] | None = None,
        *,
        plan: CommPlan | None = None,
    ) -> None:
        if plan is None and (programs is None or messages is None or local_handoffs is None):
            raise TypeError("LoweredSchedule needs a plan, or programs, messages and local_handoffs")
        self.schedule = schedule
        self.plan = plan  # None for a hand-made lowering
        self._built: dict[tuple[int, bool], tuple[Instruction, ...]] = {}
        if programs is not None:
            self.__dict__["programs"] = tuple(tuple(program) for program in programs)
        if messages is not None:
            self.__dict__["messages"] = tuple(messages)
        if local_handoffs is not None:
            self.__dict__["local_handoffs"] = tuple(local_handoffs)

    @cached_property
    def timing_plan(self) -> CommPlan:
        """:attr:`plan`, or for a hand-made lowering the plan its programs amount to."""
        return self.plan if self.plan is not None else CommPlan.from_programs(self.schedule, self.programs)

    @cached_property
    def programs(self) -> tuple[tuple[Instruction, ...], ...]:  # per rank
        return tuple(self.program(rank) for rank in range(self.schedule.num_ranks))

    @cached_property
    def messages(self) -> tuple[Message, ...]:
        """Cross-rank messages, in channel order."""
        assert self.plan is not None
        return tuple(map(self.plan.message, range(self.plan.num_messages)))

    @cached_property
    def local_handoffs(self) -> tuple[Message, ...]:
        assert self.plan is not None
        kinds, src_stages, dst_stages, microbatches, ranks = self.plan.handoffs
        return tuple(
            Message(GRAD if g else ACT, s, d, mb, r, r)
            for g, s, d, mb, r in zip(kinds, src_stages, dst_stages, microbatches, ranks, strict=True)
        )

    @cached_property
    def send_bounds(self) -> tuple[int | None, ...]:
        """Per rank, the most sends the executor keeps pending (None: no bound).

        A pending send holds one message-sized tensor. An activation's send is completed before
        that activation's backward, so rank ``r`` never has more activation sends pending than live
        stage activations: at most its peak count ``L(r)``. A gradient sent to rank ``q`` for
        ``(s, m)`` is pending until ``q`` posts the receive, before the backward of ``(s - 1, m)``
        on ``q``, whose forward already ran: while it is pending that activation is live on ``q``,
        so such sends never outnumber ``L(q)``. The bound ``L(r) + sum of L(q)`` over the ranks
        ``q`` that ``r`` sends gradients to is therefore never reached by a matched protocol; it
        caps the send buffers by counts the memory model already has, each buffer far smaller than
        a stage activation. Checked with :func:`~.progress.run_posted` on the prefetching
        programs: a bound that could deadlock is lifted (sends then complete by the end of the
        iteration at the latest)."""
        plan = self.timing_plan
        live_peak: list[int] = []
        for row in self.schedule.ops:
            live = peak = 0
            for op in row:
                live += 1 if op.kind == "F" else -1 if op.kind in ("B", "BW") else 0
                peak = max(peak, live)
            live_peak.append(peak)
        grads_to: list[set[int]] = [set() for _ in live_peak]
        for grad, src, dst in zip(plan.kind_grad, plan.src_rank, plan.dst_rank, strict=True):
            if grad:
                grads_to[src].add(dst)
        bounds: list[int | None] = [
            max(1, live_peak[r] + sum(live_peak[q] for q in grads_to[r])) for r in range(len(live_peak))
        ]
        lengths = [len(row) for row in self.schedule.ops]
        fields = (plan.src_rank, plan.dst_rank, plan.send_gap, plan.post_gap, plan.consumer)
        if run_posted(lengths, *fields, bounds) is not None:
            return (None,) * len(bounds)
        return tuple(bounds)

    @cached_property
    def buffer_counts(self) -> tuple[int, ...]:
        """Per rank, the most message-sized p2p buffers it holds at once beyond its activations: the
        receive buffers posted ahead of their consumer (``CommPlan.receive_buffers``) plus the sends
        it may keep pending (:attr:`send_bounds`, at most all its sends)."""
        plan = self.timing_plan
        sends = [0] * self.schedule.num_ranks
        for src in plan.src_rank:
            sends[src] += 1
        out = []
        for rank, held in enumerate(plan.receive_buffer_peaks()):
            bound = self.send_bounds[rank]
            pending = sends[rank] if bound is None else min(bound, sends[rank])
            out.append(held + pending)
        return tuple(out)

    def program(self, rank: int, prefetch: bool = False) -> tuple[Instruction, ...]:
        """Rank ``rank``'s instructions; with ``prefetch`` its receives sit at the prefetch positions
        (``CommPlan.post_gap``: for backends whose transfers progress on their own; a hand-made
        lowering has only its own positions)."""
        if "programs" in self.__dict__:
            return self.__dict__["programs"][rank]
        built = self._built.get((rank, prefetch))
        if built is None:
            built = self._built[(rank, prefetch)] = self._build_program(rank, prefetch)
        return built

    def _build_program(self, rank: int, prefetch: bool) -> tuple[Instruction, ...]:
        plan = self.plan
        assert plan is not None
        messages = self.messages
        row = self.schedule.ops[rank]
        sends = plan.sends_after_ops[rank]
        recvs = (plan.prefetch_groups if prefetch else plan.receive_groups)[rank]
        program: list[Instruction] = []
        for i, op in enumerate(row):
            sent = sends[i - 1] if i else -1
            got = recvs[i]
            if sent >= 0 or got is not None:
                program.append(
                    Exchange(
                        (messages[sent],) if sent >= 0 else (),
                        tuple(messages[mid] for mid in got) if got is not None else (),
                    )
                )
            program.append(Compute(op))
        if row and sends[-1] >= 0:
            program.append(Exchange((messages[sends[-1]],), ()))
        return tuple(program)

    def describe(self, rank: int) -> str:
        return "\n".join(str(i) for i in self.program(rank))


def lower(schedule: Schedule) -> LoweredSchedule:
    """Insert sends and receives into every rank's program (cached on the schedule).

    Expects a schedule whose ops are complete (every consumer has its producer);
    :func:`megatron_pp_ext.analysis.schedule_check.validate` checks that first and
    reports what is missing.
    """
    cached = schedule.__dict__.get("_lowered")
    if cached is None:
        with cyclic_gc_paused():
            cached = LoweredSchedule(schedule, plan=_plan(schedule))
        object.__setattr__(schedule, "_lowered", cached)  # schedules are immutable
    return cached


def _plan(schedule: Schedule) -> CommPlan:
    arrays = op_arrays(schedule)
    stage, mb, rank, index = arrays.stage, arrays.microbatch, arrays.rank, arrays.index
    consumer, producer, grad = _inputs(schedule, arrays)
    src, dst = rank[producer], rank[consumer]
    local = src == dst
    order = np.argsort(consumer[local], kind="stable")  # in consumer order, rank by rank
    at = consumer[local][order]
    from_ = producer[local][order]
    handoffs = tuple(a.tolist() for a in (grad[local][order], stage[from_], stage[at], mb[at], rank[at]))

    cross = ~local
    producer, consumer, grad, src, dst = producer[cross], consumer[cross], grad[cross], src[cross], dst[cross]
    send_gap, recv_gap = index[producer] + 1, index[consumer]
    if schedule.overlap_pairs:  # both inputs of an overlap pair arrive before the pair
        recv_gap = recv_gap - _second_of_pair(schedule, arrays)[consumer]
    order = np.lexsort((send_gap, dst, src))  # channel order: sender, receiver, send position
    producer, consumer, grad, src, dst = producer[order], consumer[order], grad[order], src[order], dst[order]
    send_gap, recv_gap = send_gap[order], recv_gap[order]
    channel = src * schedule.num_ranks + dst
    # Where a backend whose transfers progress on their own (gloo) posts each receive: PREFETCH_OPS
    # ops before its consumer (or before its overlap pair), in channel order, or earlier where the
    # rendezvous repair below moves it.
    prefetch = _fifo_channels(channel, np.maximum(recv_gap - PREFETCH_OPS, 0))[1]
    seq, recv_gap = _fifo_channels(channel, recv_gap)

    # The rendezvous run that repairs wait-for cycles (moves receives earlier, in recv_list).
    events = events_by_rank(schedule.num_ranks, src, dst, send_gap, recv_gap)
    grad_list, send_list, recv_list = grad.tolist(), send_gap.tolist(), recv_gap.tolist()
    stuck = run_rendezvous(events, recv_list, is_grad=grad_list, repair=True)
    post_list = np.minimum(prefetch, np.asarray(recv_list, dtype=np.int64)).tolist()
    return CommPlan(
        offsets=arrays.offsets,
        kind_grad=grad_list,
        src_stage=stage[producer].tolist(),
        dst_stage=stage[consumer].tolist(),
        microbatch=mb[consumer].tolist(),
        src_rank=src.tolist(),
        dst_rank=dst.tolist(),
        seq=seq.tolist(),
        send_gap=send_list,
        recv_gap=recv_list,
        post_gap=post_list,
        consumer=index[consumer].tolist(),
        handoffs=handoffs,
        stuck_at=None if stuck is None else tuple(stuck),
    )


def _inputs(schedule: Schedule, arrays: OpArrays) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(consumer, producer, is_grad)``: every op that takes another stage's output, the op that
    makes it (global op ids) and whether it is a gradient. A forward of ``(s, mb)`` takes
    ``F(s-1, mb)``'s activation, a backward the input gradient of ``(s+1, mb)``'s backward, except
    at the ends of a replica."""
    kind, stage, mb, rank, index = arrays.kind, arrays.stage, arrays.microbatch, arrays.rank, arrays.index
    if arrays.total and (int(stage.min()) < 0 or int(mb.min()) < 0):
        bad = int(np.flatnonzero((stage < 0) | (mb < 0))[0])
        raise ScheduleError(f"rank {rank[bad]}: {schedule.ops[rank[bad]][index[bad]]} has a negative index")
    # Ops beyond the declared stages or micro-batches are lowered all the same (the validator
    # rejects them; a rank running a mismatched schedule then fails in its exchanges, by name).
    num_stages, m = schedule.num_stages, schedule.num_microbatches
    if arrays.total:
        num_stages, m = max(num_stages, int(stage.max()) + 1), max(m, int(mb.max()) + 1)
    per_replica = schedule.placement.stages_per_replica
    cell = stage * m + mb
    ids = np.arange(arrays.total, dtype=np.int64)
    is_f = kind == KIND_F
    is_back = (kind == KIND_B) | (kind == KIND_BW)
    forward_at = np.full(num_stages * m, -1, dtype=np.int64)
    forward_at[cell[is_f]] = ids[is_f]
    backward_at = np.full(num_stages * m, -1, dtype=np.int64)
    backward_at[cell[is_back]] = ids[is_back]
    position = stage % per_replica
    act_consumers = np.flatnonzero(is_f & (position != 0))
    grad_consumers = np.flatnonzero(is_back & (position != per_replica - 1))
    consumer = np.concatenate((act_consumers, grad_consumers))
    producer = np.concatenate((forward_at[cell[act_consumers] - m], backward_at[cell[grad_consumers] + m]))
    grad = np.concatenate((np.zeros(len(act_consumers), np.int64), np.ones(len(grad_consumers), np.int64)))
    if (producer < 0).any():
        _raise_missing_producer(schedule, rank, index, consumer[producer < 0])
    return consumer, producer, grad


def _second_of_pair(schedule: Schedule, arrays: OpArrays) -> np.ndarray:
    """Per op (global id): 1 for the second op of an overlap pair, else 0."""
    second = np.zeros(arrays.total, dtype=np.int64)
    for rank, starts in enumerate(schedule.overlap_pairs):
        second[[arrays.offsets[rank] + i + 1 for i in starts]] = 1
    return second


def _fifo_channels(channel: np.ndarray, recv_gap: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Messages sorted by channel and send position: each one's sequence number on its channel, and
    its receive position moved up to the next message's receive where that is earlier (FIFO)."""
    n = len(channel)
    new_channel = np.ones(n, dtype=bool)
    new_channel[1:] = channel[1:] != channel[:-1]
    channel_index = np.cumsum(new_channel) - 1
    seq = np.arange(n, dtype=np.int64) - np.flatnonzero(new_channel)[channel_index]
    if not n:
        return seq, recv_gap
    # a running minimum from the end, restarted per channel by offsetting each channel below the
    # ones after it
    big = int(recv_gap.max()) + 1
    offset = (channel_index[-1] - channel_index[::-1]) * big
    return seq, (np.minimum.accumulate(recv_gap[::-1] - offset) + offset)[::-1]


def _raise_missing_producer(schedule: Schedule, rank: np.ndarray, index: np.ndarray, consumers: np.ndarray) -> None:
    first = int(consumers.min())  # the first such op, rank by rank
    r, i = int(rank[first]), int(index[first])
    op: Op = schedule.ops[r][i]
    if op.kind == "F":
        wanted = f"F{op.stage - 1}.{op.microbatch}"
    else:
        wanted = f"B/BW{op.stage + 1}.{op.microbatch}"
    raise ScheduleError(f"rank {r}: {op} needs the output of {wanted}, which no rank runs")
