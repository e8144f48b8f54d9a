"""Which sends of an overlap pair leave from inside megatron's combined step (runtime/combined_step.early_sends)."""

from __future__ import annotations

from megatron_pp_ext.runtime.combined_step import early_sends
from megatron_pp_ext.schedules.ir import Op, OpKind
from megatron_pp_ext.schedules.lowering import ACT, GRAD, Exchange, Message

F = Op(OpKind.F, 1, 3)
B = Op(OpKind.B, 1, 0)
ACT_TO_2 = Message(ACT, 1, 2, 3, 1, 2)
GRAD_TO_0 = Message(GRAD, 1, 0, 0, 1, 0)
GRAD_TO_2 = Message(GRAD, 1, 0, 0, 1, 2)


def test_a_forward_first_sends_its_output_early() -> None:
    between = (Exchange((ACT_TO_2,), ()),)
    assert early_sends(F, F, between, Exchange((GRAD_TO_2,), ())) == (ACT_TO_2,)


def test_a_forward_second_sends_early_unless_the_backward_sends_to_the_same_rank_before() -> None:
    after = Exchange((ACT_TO_2,), (GRAD_TO_0,))
    assert early_sends(F, B, (Exchange((GRAD_TO_0,), ()),), after) == (ACT_TO_2,)
    assert early_sends(F, B, (Exchange((GRAD_TO_2,), ()),), after) == ()  # one channel keeps its order
    assert early_sends(F, B, (), None) == ()  # a last stage sends nothing
