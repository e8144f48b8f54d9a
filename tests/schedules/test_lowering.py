"""Lowering: local hand-offs vs messages, FIFO channel order, the PP=2 same-peer case."""

from __future__ import annotations

from collections import defaultdict

import pytest

from megatron_pp_ext.schedules import (
    BW,
    Compute,
    Exchange,
    F,
    LoweredSchedule,
    Message,
    Schedule,
    ScheduleError,
    build_schedule,
    generate,
    loop_placement,
    lower,
    v_placement,
)
from megatron_pp_ext.schedules.lowering import ACT, GRAD


def _recv_order(lowered: LoweredSchedule, rank: int) -> list[Message]:
    return [m for ins in lowered.program(rank) if isinstance(ins, Exchange) for m in ins.recvs]


def _send_order(lowered: LoweredSchedule, rank: int) -> list[Message]:
    return [m for ins in lowered.program(rank) if isinstance(ins, Exchange) for m in ins.sends]


def check_well_formed(lowered: LoweredSchedule) -> None:
    """Every message sent after its producer, received before its consumer, FIFO per channel."""
    schedule = lowered.schedule
    for rank, row in enumerate(schedule.ops):
        computes = [ins.op for ins in lowered.program(rank) if isinstance(ins, Compute)]
        assert computes == list(row)
    for msg in lowered.messages:
        assert not msg.local
        producer = F(msg.src_stage, msg.microbatch) if msg.kind == ACT else None
        consumer_kind = F if msg.kind == ACT else None
        src_prog, dst_prog = lowered.program(msg.src_rank), lowered.program(msg.dst_rank)
        send_at = next(i for i, ins in enumerate(src_prog) if isinstance(ins, Exchange) and msg in ins.sends)
        recv_at = next(i for i, ins in enumerate(dst_prog) if isinstance(ins, Exchange) and msg in ins.recvs)
        produced_at = next(
            i
            for i, ins in enumerate(src_prog)
            if isinstance(ins, Compute)
            and ins.op.stage == msg.src_stage
            and ins.op.microbatch == msg.microbatch
            and (ins.op == producer if producer else ins.op.is_backward)
        )
        consumed_at = next(
            i
            for i, ins in enumerate(dst_prog)
            if isinstance(ins, Compute)
            and ins.op.stage == msg.dst_stage
            and ins.op.microbatch == msg.microbatch
            and (ins.op.kind.value == "F" if consumer_kind else ins.op.is_backward)
        )
        assert produced_at < send_at
        assert recv_at < consumed_at
    channels: dict[tuple[int, int], list[Message]] = defaultdict(list)
    for msg in lowered.messages:
        channels[(msg.src_rank, msg.dst_rank)].append(msg)
    for (src, dst), msgs in channels.items():
        assert [m.seq for m in msgs] == list(range(len(msgs)))
        assert [m for m in _send_order(lowered, src) if m.dst_rank == dst] == msgs
        assert [m for m in _recv_order(lowered, dst) if m.src_rank == src] == msgs


def test_1f1b_messages_only_between_neighbours() -> None:
    lowered = lower(generate("1f1b", 4, 6))
    check_well_formed(lowered)
    assert not lowered.local_handoffs
    assert len(lowered.messages) == 2 * 3 * 6  # act + grad per micro-batch per boundary
    assert all(abs(m.src_rank - m.dst_rank) == 1 for m in lowered.messages)
    assert {(m.kind, m.src_rank - m.dst_rank) for m in lowered.messages} == {(ACT, -1), (GRAD, 1)}


def test_single_rank_needs_no_communication() -> None:
    schedule = build_schedule(
        "solo", loop_placement(1, 2), 2, [[F(0, 0), F(1, 0), F(0, 1), F(1, 1), BW(1, 0), BW(0, 0), BW(1, 1), BW(0, 1)]]
    )
    lowered = lower(schedule)
    assert lowered.messages == ()
    assert len(lowered.local_handoffs) == 4  # act 0->1 and grad 1->0 for two micro-batches
    assert all(isinstance(ins, Compute) for ins in lowered.program(0))


def test_v_shape_turn_is_a_local_handoff() -> None:
    # p=2 V placement: stages 0 (r0), 1 (r1), 2 (r1), 3 (r0)
    schedule = build_schedule(
        "v-by-hand",
        v_placement(2),
        1,
        [[F(0, 0), F(3, 0), BW(3, 0), BW(0, 0)], [F(1, 0), F(2, 0), BW(2, 0), BW(1, 0)]],
    )
    lowered = lower(schedule)
    check_well_formed(lowered)
    assert {(m.kind, m.src_stage, m.dst_stage) for m in lowered.local_handoffs} == {(ACT, 1, 2), (GRAD, 2, 1)}
    assert all(m.local and m.src_rank == 1 for m in lowered.local_handoffs)
    assert {(m.kind, m.src_stage, m.dst_stage, m.src_rank, m.dst_rank) for m in lowered.messages} == {
        (ACT, 0, 1, 0, 1),
        (ACT, 2, 3, 1, 0),
        (GRAD, 3, 2, 0, 1),
        (GRAD, 1, 0, 1, 0),
    }


def test_out_of_order_consumer_receives_in_channel_order() -> None:
    # rank 1 consumes micro-batch 1 first; rank 0 sends 0 then 1: both receives go before F1.1,
    # in send order, so an untagged transport (NCCL) still pairs them right.
    schedule = build_schedule(
        "swap",
        loop_placement(2),
        2,
        [[F(0, 0), F(0, 1), BW(0, 1), BW(0, 0)], [F(1, 1), BW(1, 1), F(1, 0), BW(1, 0)]],
    )
    lowered = lower(schedule)
    check_well_formed(lowered)
    first = lowered.program(1)[0]
    assert isinstance(first, Exchange)
    assert [(m.microbatch, m.seq) for m in first.recvs] == [(0, 0), (1, 1)]
    assert isinstance(lowered.program(1)[1], Compute) and lowered.program(1)[1].op == F(1, 1)


def test_pp2_interleaved_same_peer_gets_act_and_grad_in_order() -> None:
    # p=2, v=2: rank 0 -> rank 1 carries activations (stages 0->1, 2->3) AND gradients (2->1);
    # the same pair of peers in both roles is megatron's PP=2 batched-p2p trap.
    lowered = lower(generate("interleaved-1f1b", 2, 4, v=2))
    check_well_formed(lowered)
    for src, dst in ((0, 1), (1, 0)):
        channel = [m for m in lowered.messages if (m.src_rank, m.dst_rank) == (src, dst)]
        assert {m.kind for m in channel} == {ACT, GRAD}
        # an exchange that batches an act and a grad to the same peer lists them by seq
        for ins in lowered.program(src):
            if isinstance(ins, Exchange):
                seqs = [m.seq for m in ins.sends if m.dst_rank == dst]
                assert seqs == sorted(seqs)
    mixed = [
        ins
        for ins in lowered.program(0)
        if isinstance(ins, Exchange) and {m.kind for m in (*ins.sends, *ins.recvs)} == {ACT, GRAD}
    ]
    assert mixed, "expected a batched exchange with both an activation and a gradient"
    assert not lowered.local_handoffs


@pytest.mark.parametrize(("p", "m", "v"), [(2, 2, 2), (3, 6, 2), (4, 8, 3), (4, 12, 2)])
def test_interleaved_lowering_well_formed(p: int, m: int, v: int) -> None:
    lowered = lower(generate("interleaved-1f1b", p, m, v=v))
    check_well_formed(lowered)
    assert len(lowered.messages) == 2 * (p * v - 1) * m


def test_missing_producer_is_reported() -> None:
    with pytest.raises(ScheduleError, match=r"rank 1: F1.0 needs the output of F0.0, which no rank runs"):
        lower(Schedule(loop_placement(2), 1, ((), (F(1, 0), BW(1, 0)))))
    with pytest.raises(ScheduleError, match=r"rank 0: BW0.0 needs the output of B/BW1.0"):
        lower(Schedule(loop_placement(2), 1, ((F(0, 0), BW(0, 0)), (F(1, 0),))))


# ---- the array implementation against the plain statement of the algorithm ------------------
def _all_small_schedules() -> list[Schedule]:
    from megatron_pp_ext.schedules import names

    out = []
    for name in names():
        for p, m, v in ((2, 3, None), (3, 5, None), (4, 8, None), (4, 8, 2), (3, 7, 3), (2, 1, None)):
            try:
                out.append(generate(name, p, m, v=v))
            except ScheduleError:
                pass
    return out


@pytest.mark.parametrize(
    "schedule", _all_small_schedules(), ids=lambda s: f"{s.name}-p{s.num_ranks}-m{s.num_microbatches}"
)
def test_lowering_equals_reference_algorithm(schedule: Schedule) -> None:
    from .reference_lowering import reference_programs

    programs, messages = reference_programs(schedule)
    lowered = lower(schedule)
    assert lowered.programs == programs
    assert sorted(lowered.messages) == sorted(messages)


def test_lowering_equals_reference_on_random_orders() -> None:
    import random

    from tests.analysis.helpers import random_serial_schedule

    from .reference_lowering import reference_programs

    rng = random.Random(7)
    for _ in range(60):
        placement = rng.choice([loop_placement(rng.randint(2, 4), rng.randint(1, 3)), v_placement(rng.randint(2, 3))])
        schedule = random_serial_schedule(rng, placement, rng.randint(1, 5), rng.random() < 0.5)
        assert lower(schedule).programs == reference_programs(schedule)[0]


@pytest.mark.parametrize(
    "schedule", _all_small_schedules(), ids=lambda s: f"{s.name}-p{s.num_ranks}-m{s.num_microbatches}"
)
def test_receives_are_prefetched_one_op_ahead_in_channel_order(schedule: Schedule) -> None:
    """Each receive is posted (``post_gap``) before the op preceding its consumer, never after its
    rendezvous position, and per channel in send order; the prefetching program holds exactly
    those receives there, and the send bound never deadlocks the protocol."""
    from megatron_pp_ext.schedules.lowering import PREFETCH_OPS
    from megatron_pp_ext.schedules.progress import run_posted

    lowered = lower(schedule)
    plan = lowered.plan
    assert plan is not None
    channels: dict[tuple[int, int], list[int]] = {}
    for mid in range(plan.num_messages):
        assert plan.post_gap[mid] <= max(plan.consumer[mid] - PREFETCH_OPS, 0)
        assert plan.post_gap[mid] <= plan.recv_gap[mid]
        channels.setdefault((plan.src_rank[mid], plan.dst_rank[mid]), []).append(mid)
    for mids in channels.values():
        ordered = sorted(mids, key=lambda mid: plan.seq[mid])
        gaps = [plan.post_gap[mid] for mid in ordered]
        assert gaps == sorted(gaps)
    for rank in range(schedule.num_ranks):
        gap, found = 0, {}
        for ins in lowered.program(rank, prefetch=True):
            if isinstance(ins, Compute):
                gap += 1
            else:
                found.update({msg: gap for msg in ins.recvs})
        assert found == {plan.message(mid): plan.post_gap[mid] for mid in range(plan.num_messages)
                         if plan.dst_rank[mid] == rank}  # fmt: skip
    lengths = [len(row) for row in schedule.ops]
    fields = (plan.src_rank, plan.dst_rank, plan.send_gap, plan.post_gap, plan.consumer)
    assert run_posted(lengths, *fields, lowered.send_bounds) is None


def test_a_send_bound_can_deadlock_where_no_bound_does() -> None:
    """Rank 0 sends b to rank 1, then y to rank 2; rank 2 turns y into x for rank 1, which consumes x
    before it posts b's receive. Unbounded, everything completes; with no send allowed to stay
    pending, rank 0 waits for b's receive before sending y: a deadlock the check must see (and
    ``LoweredSchedule.send_bounds`` then lifts the bound)."""
    from megatron_pp_ext.schedules.progress import run_posted

    lengths = [2, 2, 1]
    src, dst = [0, 0, 2], [1, 2, 1]  # messages b, y, x
    send_gap, post_gap, consumer = [1, 2, 1], [1, 0, 0], [1, 0, 0]
    assert run_posted(lengths, src, dst, send_gap, post_gap, consumer, [None, None, None]) is None
    assert run_posted(lengths, src, dst, send_gap, post_gap, consumer, [1, 1, 1]) is None
    assert run_posted(lengths, src, dst, send_gap, post_gap, consumer, [0, None, None]) is not None
