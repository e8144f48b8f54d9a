"""The one timing core (schedules/timing.time_ops) on hand-made programs: each option's rule, exactly."""

from __future__ import annotations

import pytest

from megatron_pp_ext.schedules.timing import time_ops


def test_an_op_waits_for_its_own_input_only() -> None:
    # rank 0: a (1) sends message 0, then b (1); rank 1: c (2) waits for message 0, latency 0.5
    t = time_ops([[1.0, 1.0], [2.0]], [[-1, -1], [0]], [[0, -1], [-1]], [1], [0.5])
    assert t.starts == [[0.0, 1.0], [1.5]] and t.last_end == [2.0, 3.5]


def test_groups_wait_for_every_message_and_send_several() -> None:
    # rank 0 sends message 0 after its first op and message 1 after its second; rank 1's op waits for both
    waits = [[None, None], [(0, 1)]]
    sends = [[(0,), (1,)], [None]]
    t = time_ops([[1.0, 3.0], [1.0]], waits, sends, [1, 1], [0.25, 0.25], groups=True)
    assert t.starts == [[0.0, 1.0], [4.25]] and t.last_end == [4.0, 5.25]


def test_an_overlap_pair_is_one_step_that_sends_both_outputs_at_its_end() -> None:
    # rank 0: ops 0 (1) and 1 (2) overlapped by half: max + 0.5 min = 2.5; op 0's message leaves at 2.5
    t = time_ops([[1.0, 2.0], [1.0]], [[-1, -1], [0]], [[0, -1], [-1]], [1], [0.0], pairs=[[0], []], overlap=0.5)
    assert t.starts == [[0.0, 0.0], [2.5]] and t.last_end == [2.5, 3.5]
    plain = time_ops([[1.0, 2.0], [1.0]], [[-1, -1], [0]], [[0, -1], [-1]], [1], [0.0], pairs=[[0], []])
    assert plain.starts == [[0.0, 1.0], [1.0]]  # overlap 0: two plain ops


def test_a_collective_runs_on_the_stream_and_gates_the_op_that_needs_it() -> None:
    # rank 0: ops of 1 each; a collective of 3 issued at gap 1 (after op 0), op 1 waits for it
    t = time_ops([[1.0, 1.0]], [[-1, -1]], [[-1, -1]], [], [], collectives=[[(1, 3.0), (2, 0.5)]], gates=[[-1, 0]])
    assert t.starts == [[0.0, 4.0]] and t.stall == [3.0]
    assert t.issue == [[1.0, 5.0]] and t.begin == [[1.0, 5.0]] and t.end == [[4.0, 5.5]]


def test_a_message_never_sent_is_reported() -> None:
    with pytest.raises(RuntimeError, match="ranks \\[1\\]"):
        time_ops([[1.0], [1.0]], [[-1], [0]], [[-1], [-1]], [1], [0.0])


def test_a_pair_sends_each_output_at_its_own_time_in_channel_order() -> None:
    # rank 0: pair of ops 0 and 1 lasting 5; op 0's output leaves at 2, op 1's at 1; both go to rank 1
    # (latency 1), whose ops wait for message 1 then message 0. Message 0 arrives at 3; message 1 may not
    # overtake message 0 on their channel: it leaves at 2 too, arrives at 3 (not 2).
    durations = [[1.0, 1.0], [1.0, 1.0]]
    waits = [[-1, -1], [1, 0]]
    sends = [[0, 1], [-1, -1]]
    kwargs = {"pairs": [[0], []], "pair_durations": [{0: 5.0}, {}], "pair_sends": [{0: (2.0, 1.0)}, {}]}
    t = time_ops(durations, waits, sends, [1, 1], [1.0, 1.0], **kwargs)  # type: ignore[arg-type]
    assert t.starts == [[0.0, 0.0], [3.0, 4.0]] and t.last_end == [5.0, 5.0]
    # to another rank, op 1's output keeps its own time (leaves at 1, arrives at 2 on rank 2)
    durations, waits, sends = [[1.0, 1.0], [1.0], [1.0]], [[-1, -1], [0], [1]], [[0, 1], [-1], [-1]]
    t = time_ops(durations, waits, sends, [1, 2], [1.0, 1.0], **kwargs | {"pairs": [[0], [], []]})  # type: ignore[arg-type]
    assert t.starts == [[0.0, 0.0], [3.0], [2.0]]
    # without pair_sends both leave at the pair's end
    steps = [{0: 5.0}, {}, {}]
    plain = time_ops(durations, waits, sends, [1, 2], [1.0, 1.0], pairs=[[0], [], []], pair_durations=steps)
    assert plain.starts == [[0.0, 0.0], [6.0], [6.0]]
