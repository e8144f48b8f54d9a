"""Overlap pairs read off any schedule (schedules/pairs.py) and the validator's check of them."""

from __future__ import annotations

import pytest

from megatron_pp_ext.analysis.schedule_check import DependencyError, validate
from megatron_pp_ext.schedules import Exchange, OpKind, Schedule, generate, lower
from megatron_pp_ext.schedules.lowering import LoweredSchedule, Message
from megatron_pp_ext.schedules.pairs import blocked_pairs, mark_pairs


def _cells(schedule: Schedule, rank: int) -> str:
    return " ".join(schedule.pair_cells(rank))


def _pairs(schedule: Schedule, rank: int) -> list[str]:
    return [c for c in schedule.pair_cells(rank) if "+" in c]


def _sends(lowered: LoweredSchedule, rank: int) -> list[Message]:
    return [msg for ins in lowered.program(rank) if isinstance(ins, Exchange) for msg in ins.sends]


def test_1f1b_steady_state_pairs_each_forward_with_the_oldest_backward() -> None:
    s = mark_pairs(generate("1f1b", 2, 4))
    assert _cells(s, 0) == "F0.0 F0.1+BW0.0 F0.2+BW0.1 F0.3+BW0.2 BW0.3"
    # the last rank's B-then-F steps would wait for rank 0's pairs, which wait for them: not paired
    assert _pairs(s, 1) == []
    s = mark_pairs(generate("1f1b", 4, 8))
    assert _pairs(s, 0) == [f"F0.{3 + k}+BW0.{k}" for k in range(5)]
    assert _pairs(s, 2) == [f"F2.{1 + k}+BW2.{k}" for k in range(7)]


def test_interleaved_1f1b_pairs_on_every_rank() -> None:
    s = mark_pairs(generate("interleaved-1f1b", 2, 4))
    assert [len(row) for row in s.overlap_pairs] == [4, 5]
    assert _pairs(s, 0) == ["F0.2+BW2.0", "F0.3+BW2.1", "F2.2+BW0.0", "F2.3+BW0.1"]


def test_zb_h1_pairs_forward_with_b_and_keeps_w_alone() -> None:
    s = mark_pairs(generate("zb-h1", 2, 4))
    assert _pairs(s, 0) == ["F0.1+B0.0", "F0.2+B0.1", "F0.3+B0.2"]
    for rank, starts in enumerate(s.overlap_pairs):
        for i in starts:
            assert OpKind.W not in {op.kind for op in s.ops[rank][i : i + 2]}


def test_v_zb_pairs_both_chunks() -> None:
    s = mark_pairs(generate("v-zb", 4, 8))
    assert "F6.1+B6.0" in _pairs(s, 1) and "F1.6+B1.0" in _pairs(s, 1)
    assert [len(row) for row in s.overlap_pairs] == [1, 9, 9, 9]


def test_dualpipev_keeps_its_own_pairs() -> None:
    s = generate("dualpipev", 4, 8)
    assert mark_pairs(s) is s


@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "v-zb", "v-half", "bitpipe"])
@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (4, 12)])
def test_pairs_keep_the_messages_and_validate(name: str, p: int, m: int) -> None:
    plain = generate(name, p, m)
    paired = mark_pairs(plain)
    assert paired.ops == plain.ops and any(paired.overlap_pairs)
    validate(paired)
    assert blocked_pairs(paired) == []
    a, b = lower(plain), lower(paired)
    assert a.messages == b.messages  # the same messages, each at the same place on its channel
    for rank in range(p):  # and every rank sends them in the same order
        assert _sends(a, rank) == _sends(b, rank)
    for rank, starts in enumerate(paired.overlap_pairs):
        for i in starts:
            first, second = paired.ops[rank][i : i + 2]
            assert {first.kind, second.kind} & {OpKind.F} and first.microbatch != second.microbatch


def test_gpipe_has_no_steady_state_pairs() -> None:
    s = mark_pairs(generate("gpipe", 4, 8))
    assert max(len(row) for row in s.overlap_pairs) <= 1


def test_validator_refuses_a_pair_whose_second_input_waits_for_the_first() -> None:
    plain = generate("1f1b", 2, 4)
    # each pair alone is fine; together F0.1 waits for BW0.0's input, made after BW1.0, which with
    # rank 1's pair waits for F1.1's input, made by F0.1: a cycle
    for one in ([[1], []], [[], [1]]):
        assert blocked_pairs(plain.with_overlap_pairs(one)) == []
    bad = plain.with_overlap_pairs([[1], [1]])
    assert _cells(bad, 1).startswith("F1.0 BW1.0+F1.1")
    assert blocked_pairs(bad) == [(0, 1), (1, 1)]
    with pytest.raises(DependencyError, match=r"rank 0: overlap pair F0\.1\+BW0\.0 at op 1: the input of BW0\.0"):
        validate(bad)
