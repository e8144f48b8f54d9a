"""The tracer's host split: what it counts between ops, from the events the runtime reports (no timing bound)."""

from __future__ import annotations

import pytest

from megatron_pp_ext.runtime.trace import Tracer
from megatron_pp_ext.schedules.ir import Op, OpKind


def _iteration(tracer: Tracer, ops: list[Op]) -> None:
    tracer.begin_iteration()
    for op in ops:
        tracer.protocol("recv-wait", "act", waited_s=0.002)  # a wait the channels measured
        tracer.protocol("recv-post", "act")  # no wait: not counted
        tracer.begin_op(op)
        tracer.end_op(op)
        tracer.begin_comm()
        tracer.end_comm()
    tracer.end_iteration()


def test_parts_counted_per_event_and_bookkeeping_is_the_rest_of_the_time_between_ops() -> None:
    tracer = Tracer(0, track_memory=False)
    ops = [Op(OpKind.F, 0, 0), Op(OpKind.B, 0, 0), Op(OpKind.W, 0, 0)]
    _iteration(tracer, ops)
    split = tracer.host_split()
    parts = split["parts"]
    assert split["ops"] == 3
    assert parts["p2p posting"]["count"] == 3 and parts["p2p wait"]["count"] == 3
    assert parts["p2p wait"]["s"] == pytest.approx(0.006) and parts["p2p wait"]["median_s"] == pytest.approx(0.002)
    between = tracer.iterations[-1]["step_time_s"] - tracer.iterations[-1]["busy_s"]
    named = parts["p2p posting"]["s"] + parts["p2p wait"]["s"]
    assert parts["bookkeeping"]["s"] == pytest.approx(max(between - named, 0.0))
    assert split["per_op_s"]["p2p wait"] == pytest.approx(0.002)


def test_restart_leaves_the_iterations_so_far_out() -> None:
    tracer = Tracer(0, track_memory=False)
    _iteration(tracer, [Op(OpKind.F, 0, 0)])
    tracer.restart()
    assert tracer.host_split()["ops"] == 0 and tracer.op_times() == {} and tracer.iterations == []
    _iteration(tracer, [Op(OpKind.F, 0, 0), Op(OpKind.BW, 0, 0)])
    assert tracer.host_split()["ops"] == 2 and tracer.host_split()["parts"]["p2p posting"]["count"] == 2
