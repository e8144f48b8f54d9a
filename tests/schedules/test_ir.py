"""Op text syntax: round trip and syntax errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pp_ext.schedules import BW, B, F, Op, OpKind, ScheduleError, ScheduleSyntaxError, W


@pytest.mark.parametrize(
    ("text", "op"),
    [("F3.0", F(3, 0)), ("B0.12", B(0, 12)), ("W7.7", W(7, 7)), ("BW0.0", BW(0, 0)), ("  F1.2 ", F(1, 2))],
)
def test_parse_known_ops(text: str, op: Op) -> None:
    assert Op.parse(text) == op
    assert str(op) == text.strip()


@given(st.sampled_from(list(OpKind)), st.integers(0, 10_000), st.integers(0, 10_000))
@settings(max_examples=200, deadline=None)
def test_str_parse_round_trip(kind: OpKind, stage: int, microbatch: int) -> None:
    op = Op(kind, stage, microbatch)
    assert Op.parse(str(op)) == op
    assert str(Op.parse(str(op))) == str(op)


@pytest.mark.parametrize(
    "text", ["", "F", "F3", "F3.", "X1.2", "f1.2", "F-1.2", "F1.-2", "FW1.2", "F1.2.3", "1.2", "F1,2"]
)
def test_bad_syntax_is_a_schedule_syntax_error(text: str) -> None:
    with pytest.raises(ScheduleSyntaxError, match=r"expected <KIND><stage>\.<microbatch>"):
        Op.parse(text)


def test_backward_flag() -> None:
    assert [k for k in OpKind if Op(k, 0, 0).is_backward] == [OpKind.B, OpKind.BW]


def test_errors_are_value_errors() -> None:
    assert issubclass(ScheduleSyntaxError, ScheduleError)
    assert issubclass(ScheduleError, ValueError)


def test_op_grid_holds_every_op_of_a_kind_once_and_shares_it():
    from megatron_pp_ext.schedules.ir import op_grid

    grid = op_grid(OpKind.W, 3, 4)
    assert [[str(op) for op in row] for row in grid] == [[f"W{s}.{k}" for k in range(4)] for s in range(3)]
    assert all(type(op) is Op and op == Op(OpKind.W, s, k) for s, row in enumerate(grid) for k, op in enumerate(row))
    assert op_grid(OpKind.W, 3, 4)[2][3] is grid[2][3]  # built once: list schedulers take ops from here
