"""The overlapped order: warm-up deepened where the pairs need it (analysis/overlap_order.py, schedules/pairs.py)."""

from __future__ import annotations

from collections import Counter

import pytest

from megatron_pp_ext.analysis.moe_comm import MoeComm
from megatron_pp_ext.analysis.overlap_order import lag_candidates, overlap_order
from megatron_pp_ext.analysis.schedule_check import validate
from megatron_pp_ext.analysis.simulate import simulate
from megatron_pp_ext.schedules import generate
from megatron_pp_ext.schedules.generators.baselines import interleaved_warmup
from megatron_pp_ext.schedules.ir import OpKind
from megatron_pp_ext.schedules.pairs import blocked_pairs, deepen, mark_pairs

A2A = MoeComm(0.5, 2, overlap=True)
SERIAL = MoeComm(0.5, 2, overlap=False)


def test_deepen_moves_each_backward_lag_forwards_later_and_keeps_every_op() -> None:
    schedule = generate("1f1b", 4, 8)
    deep = deepen(schedule, (4, 3, 2, 1))
    for rank, (before, after) in enumerate(zip(schedule.ops, deep.ops, strict=True)):
        assert Counter(before) == Counter(after)
        for kind in (OpKind.F, OpKind.BW):  # each kind keeps its order
            assert [op for op in before if op.kind == kind] == [op for op in after if op.kind == kind]
        first_backward = next(i for i, op in enumerate(after) if op.kind == OpKind.BW)
        assert first_backward == min(2 * (4 - rank - 1) + 1, 8) + 1  # warm-up 2(p-r-1)+1, then F, then BW
    with pytest.raises(ValueError, match="one number >= 0 per rank"):
        deepen(schedule, (1, 1))


def test_one_chunk_1f1b_gets_the_lockstep_lag_and_the_overlap_pays() -> None:
    """Without the deeper warm-up every pair waits for the neighbour's pair of the same step: overlap
    is slower than none (105 against 77); with it, faster."""
    schedule = generate("1f1b", 4, 8)
    ordered = overlap_order(schedule)
    assert ordered.params["pair_lags"] == (4, 3, 2, 1)
    assert blocked_pairs(ordered) == []
    validate(ordered)
    without = simulate(schedule, moe=SERIAL).makespan
    naive = simulate(mark_pairs(schedule), moe=A2A).makespan
    overlapped = simulate(ordered, moe=A2A).makespan
    assert (without, naive) == (77.0, 105.0)
    assert overlapped < without * 0.8
    assert max(simulate(ordered).peak_activations) == 2 * 4  # the price: twice 1F1B's p in flight on rank 0


def test_interleaved_1f1b_gets_megatrons_extra_warm_up_micro_batch() -> None:
    """megatron-core's interleaved 1F1B with the flag runs one more warm-up forward on every rank."""
    p, m, v = 4, 8, 2
    ordered = overlap_order(generate("interleaved-1f1b", p, m, v=v))
    for rank, row in enumerate(ordered.ops):
        warmup = next(i for i, op in enumerate(row) if op.kind == OpKind.BW) - 1  # then one F, then BW
        assert warmup == interleaved_warmup(p, rank, m, v, p) + 1
    assert simulate(ordered, moe=A2A).makespan < simulate(generate("interleaved-1f1b", p, m), moe=SERIAL).makespan


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "zb-h2", "interleaved-1f1b", "interleaved-zb", "v-zb", "zeropp"])
@pytest.mark.parametrize(("p", "m"), [(2, 8), (4, 16)])
def test_overlap_is_faster_than_none_and_than_the_pairs_as_generated(name: str, p: int, m: int) -> None:
    schedule = generate(name, p, m)
    ordered = overlap_order(schedule)
    overlapped = simulate(ordered, moe=A2A).makespan
    assert overlapped < simulate(schedule, moe=SERIAL).makespan
    assert overlapped <= simulate(mark_pairs(schedule), moe=A2A).makespan
    assert Counter(op for row in ordered.ops for op in row) == Counter(op for row in schedule.ops for op in row)


def test_dualpipev_keeps_its_own_order_and_pairs() -> None:
    schedule = generate("dualpipev", 4, 16)
    assert overlap_order(schedule) is schedule


def test_a_lag_that_deadlocks_is_not_chosen() -> None:
    schedule = generate("v-half", 4, 16)
    assert (4, 3, 2, 1) in lag_candidates(schedule)
    ordered = overlap_order(schedule)
    assert "pair_lags" not in ordered.params  # the deeper candidates deadlock or are slower here
    assert ordered.ops == schedule.ops
