"""The MoE all-to-all model of the simulator: serial all-to-alls, and overlapped F&B pairs on two streams."""

from __future__ import annotations

import random

import pytest

from megatron_pp_ext.analysis.moe_comm import MoeComm, pair_nodes, pair_step, pair_time, timed_nodes
from megatron_pp_ext.analysis.schedule_check import validate
from megatron_pp_ext.analysis.simulate import simulate
from megatron_pp_ext.schedules import registry
from megatron_pp_ext.schedules.costs import Costs
from megatron_pp_ext.schedules.schedule import Schedule
from megatron_pp_ext.schedules.timing import op_start_times

# one rank, two micro-batches, one pair: F of micro-batch 1 beside the backward of micro-batch 0
TINY = "0,F0.0,F0.1+BW0.0,BW0.1\n"


def test_pair_nodes_by_hand() -> None:
    # F compute 4 (attention 2, experts 2), B compute 8 (experts 4, attention 4), all-to-all 3, one MoE layer.
    # comm stream: B combine 0-3, F dispatch 3-6, B dispatch 7-10 (after B experts), F combine 10-13
    # compute:     F attn 0-2, B experts 3-7 (after B combine), F experts 7-9, B attn 10-14 (after B dispatch)
    timed = [(n.side, n.name, start, end) for n, start, end in timed_nodes(pair_nodes(4, 1, 8, 1, 3))]
    assert timed == [
        ("B", "combine", 0, 3),
        ("F", "attn", 0, 2),
        ("B", "experts", 3, 7),
        ("F", "dispatch", 3, 6),
        ("B", "dispatch", 7, 10),
        ("F", "experts", 7, 9),
        ("F", "combine", 10, 13),
        ("B", "attn", 10, 14),
    ]
    assert pair_time(4, 1, 8, 1, 3) == 14


def test_a_pair_sends_each_output_when_its_side_ends() -> None:
    # (above) the forward's last node (combine) ends at 13, the backward's (attention) at 14
    assert pair_step(4, 1, 8, 1, 3) == (14, 13, 14)
    # CPU launch: the host calls post_forward after the compute it issued before (B attention, to 17)
    assert pair_step(4, 1, 8, 1, 3, host_launch=True) == (17, 17, 17)


def test_tiny_schedule_makespan_by_hand() -> None:
    schedule = Schedule.from_csv(TINY)
    costs = Costs(4, 8, 0)  # BW = 8
    # serial: F = 4 + 2 x 3 = 10, BW = 8 + 2 x 3 = 14; F0.0, F0.1, BW0.0, BW0.1 one after the other
    serial = simulate(schedule, costs, moe=MoeComm(3.0, 1))
    assert serial.makespan == 10 + 10 + 14 + 14
    # overlapped: F0.0 (10), the pair (14, by hand above), BW0.1 (14)
    overlapped = simulate(schedule, costs, moe=MoeComm(3.0, 1, overlap=True))
    assert overlapped.makespan == 10 + 14 + 14
    assert overlapped.busy == [38.0]


def test_two_layers_pair_by_hand() -> None:
    # per layer F: attn 1, dispatch 3, experts 1, combine 3; B: combine 3, experts 2, dispatch 3, attn 2.
    # layer pair 0 (F layer 0 with B layer 1): comm B.combine 0-3, F.dispatch 3-6, B.dispatch 6-9, F.combine 9-12;
    #   compute F.attn 0-1, B.experts 3-5, F.experts 6-7, B.attn 9-11
    # layer pair 1: comm B.combine 12-15, F.dispatch 15-18, B.dispatch 18-21, F.combine 21-24;
    #   compute F.attn 12-13, B.experts 15-17, F.experts 18-19, B.attn 21-23
    # the communication stream is the critical path: 8 all-to-alls of 3
    assert pair_time(4, 2, 8, 2, 3) == 24
    schedule = Schedule.from_csv(TINY)
    costs = Costs(4, 8, 0)
    assert simulate(schedule, costs, moe=MoeComm(3.0, 2, overlap=True)).makespan == (4 + 12) + 24 + (8 + 12)
    assert simulate(schedule, costs, moe=MoeComm(3.0, 2)).makespan == 2 * (4 + 12) + 2 * (8 + 12)


def test_dense_stage_in_a_pair_hides_the_other_sides_all_to_alls() -> None:
    # F on a stage without MoE layers (attention 2.5, experts 2.5, no all-to-all) beside a B with one MoE layer
    # (combine 2, experts 2, dispatch 2, attention 2): B.combine comm 0-2, F.attn 0-2.5, B.experts 2.5-4.5,
    # F.dispatch 2.5-2.5, B.dispatch comm 4.5-6.5, F.experts 4.5-7, F.combine 7-7, B.attn 7-9
    assert pair_time(5, 0, 4, 1, 2) == 9
    assert pair_time(5, 0, 4, 0, 2) == 9  # no all-to-all anywhere: the two computes one after the other


def test_overlapped_pair_is_never_longer_than_its_ops_one_after_the_other() -> None:
    rng = random.Random(5)
    for _ in range(500):
        f, b, a = rng.uniform(0.1, 5), rng.uniform(0.1, 9), rng.choice([0.0, rng.uniform(0, 4)])
        lf, lb = rng.randint(0, 4), rng.randint(0, 4)
        t = pair_time(f, lf, b, lb, a)
        serial = f + b + 2 * (lf + lb) * a
        assert t <= serial + 1e-9
        assert t >= f + b - 1e-9  # the compute stream runs both computes
        assert t >= 2 * (lf + lb) * a - 1e-9  # and the communication stream every all-to-all
        if a == 0:
            assert t == pytest.approx(f + b)


PAIRED = [name for name in registry.names() if name == "dualpipev"]


@pytest.mark.parametrize("name", PAIRED)
@pytest.mark.parametrize("p,m", [(2, 4), (4, 8)])
def test_zero_all_to_all_time_is_the_old_model(name: str, p: int, m: int) -> None:
    schedule = registry.generate(name, p, m)
    lowered = validate(schedule)
    costs = Costs(1.0, 1.5, 0.7, None, 0.1)
    plain = simulate(schedule, costs, lowered=lowered)
    assert simulate(schedule, costs, lowered=lowered, moe=MoeComm(0.0, 3)).makespan == plain.makespan
    # overlapped with zero all-to-all time: each pair is its two ops one after the other as one step, as the
    # old pair model with no hiding (a tiny overlap factor)
    paired_old = simulate(schedule, costs, lowered=lowered, overlap=1e-12).makespan
    paired_new = simulate(schedule, costs, lowered=lowered, moe=MoeComm(0.0, 3, overlap=True)).makespan
    assert paired_new == pytest.approx(paired_old, abs=1e-6)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 16)])
def test_overlap_never_makes_the_simulated_time_worse(p: int, m: int) -> None:
    """Against the same pairs run as steps with their ops one after the other (what the executor does without
    the overlap): hiding all-to-alls never delays anything. (Against no pairs at all it can: a pair starts
    once both its inputs are there and its forward ends with its last node, docs/moe.md.)"""
    schedule = registry.generate("dualpipev", p, m)
    lowered = validate(schedule)
    rng = random.Random(p * 100 + m)
    for _ in range(6):
        costs = Costs(rng.uniform(0.5, 2), rng.uniform(0.5, 3), rng.uniform(0, 1), None, rng.uniform(0, 0.3))
        moe = MoeComm(rng.choice([0.0, rng.uniform(0, 1)]), rng.randint(1, 4), overlap=True)
        on = simulate(schedule, costs, lowered=lowered, moe=moe)
        serial = simulate(schedule, costs, lowered=lowered, moe=MoeComm(moe.a2a, moe.layers))
        per_op = [_op_times(serial, rank) for rank in range(schedule.num_ranks)]
        pairs = zip(per_op, schedule.overlap_pairs, strict=True)
        steps = [{i: row[i] + row[i + 1] for i in firsts} for row, firsts in pairs]
        stepped = op_start_times(lowered, per_op, float(costs.t_comm), pair_durations=steps)[1]
        assert on.makespan <= max(stepped) + 1e-9


def _op_times(result: object, rank: int) -> list[float]:
    """Every op's duration on ``rank`` from a result's timeline (serial: an op's end minus its start)."""
    return [end - start for r, _, start, end in result.timeline if r == rank]  # type: ignore[attr-defined]


def test_bad_moe_input_is_refused() -> None:
    with pytest.raises(ValueError, match="a2a"):
        MoeComm(-1.0, 2)
    with pytest.raises(ValueError, match="layers"):
        MoeComm(1.0, -2)
    schedule = Schedule.from_csv(TINY)
    with pytest.raises(ValueError, match="either overlap"):
        simulate(schedule, Costs(1, 1, 1), overlap=0.5, moe=MoeComm(1.0, 1, overlap=True))
    with pytest.raises(ValueError, match="per-stage"):
        simulate(schedule, Costs(1, 1, 1), moe=MoeComm(1.0, (1, 2)))
