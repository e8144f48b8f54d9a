"""The p2p protocol's order, read from the trace of real gloo runs (no timing involved).

From every rank's recorded protocol events (receive posted / waited, send posted / completed, each
with the number of ops the rank had run):

(a) an op waits only for its own input: every receive waited for is the input of the op about to
    run, and no op waits for a send except to free the output its backward differentiates (reason
    ``free``); the send bound is never the reason in these runs;
(b) every receive is posted exactly where the lowering's prefetch positions put it, which is before
    the op preceding its consumer (the pure check of the lowering is in tests/schedules);
(c) every send posted in the iteration completed within it.

Receive buffers posted ahead are counted as live memory: the tracer's peak includes them.
"""

from __future__ import annotations

import pytest

from megatron_pp_ext.schedules import generate, lower
from megatron_pp_ext.verification.run_spec import OURS, RunSpec
from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec

CASES = [("zb-h2", 2, 4), ("v-zb", 2, 4), ("interleaved-1f1b", 2, 4), ("1f1b", 4, 8)]


def _protocol_runs(pool, name: str, p: int, m: int):
    schedule = generate(name, p, m)
    spec = RunSpec(
        pp=p,
        num_microbatches=m,
        mode=OURS,
        schedule_csv=schedule.to_csv(),
        trace=True,
        split_backward=schedule.splits_backward,
        model=TinyGPTSpec(num_layers=schedule.placement.stages_per_replica),
        iterations=2,
    )
    results = pool.run(spec)
    errors = [r.get("error") for r in results if r.get("error")]
    assert not errors, errors[0]
    return schedule, sorted(results, key=lambda r: r["pp_rank"])


@pytest.mark.parametrize(("name", "p", "m"), CASES)
def test_protocol_order_from_the_trace(pool, name: str, p: int, m: int) -> None:
    schedule, results = _protocol_runs(pool, name, p, m)
    lowered = lower(schedule)
    plan = lowered.plan
    assert plan is not None
    for rank, result in enumerate(results):
        events = result["trace"]["last_iteration_protocol"]
        row = schedule.ops[rank]
        received = {str(plan.message(mid)): mid for mid in range(plan.num_messages) if plan.dst_rank[mid] == rank}
        sent = {str(plan.message(mid)): mid for mid in range(plan.num_messages) if plan.src_rank[mid] == rank}
        posted_at = {e["what"]: e["gap"] for e in events if e["event"] == "recv-post"}
        # (b) receives posted where the lowering says, before the op preceding their consumer
        assert posted_at == {what: plan.post_gap[mid] for what, mid in received.items()}, rank
        for what, mid in received.items():
            assert posted_at[what] <= max(plan.consumer[mid] - 1, 0), (rank, what)
        # (a) a receive is waited for only by its consumer, just before it runs (every wait of the
        # rank on a transfer is recorded, whoever waits)
        waits = [e for e in events if e["event"] == "wait"]
        for e in waits:
            if not e["send"]:
                assert e["gap"] == plan.consumer[received[e["what"]]], (rank, e)
        # ... and a send only where the protocol completes it (free, end of iteration, bound)
        completions = {(e["what"], e["gap"]) for e in events if e["event"] == "send-done" and e["how"] != "polled"}
        for e in waits:
            if e["send"]:
                assert (e["what"], e["gap"]) in completions, (rank, e)
        # (a) no op waits on a send, except to free the output its backward differentiates
        for e in events:
            if e["event"] != "send-done" or e["how"] in ("polled", "end"):
                continue
            assert e["how"] == "free", (rank, e)
            op = row[e["gap"]]
            mid = sent[e["what"]]
            assert op.kind != "F" and (plan.src_stage[mid], plan.microbatch[mid]) == (op.stage, op.microbatch), (
                rank,
                e,
            )
        # (c) every send completed within the iteration
        done = [e["what"] for e in events if e["event"] == "send-done"]
        assert sorted(done) == sorted(sent), rank
        posted_sends = [e["what"] for e in events if e["event"] == "send-post"]
        assert sorted(posted_sends) == sorted(sent), rank


def test_receive_buffers_and_pending_sends_are_counted_by_the_tracer() -> None:
    """A receive buffer posted ahead counts as live from its posting until its consumer takes it;
    pending sends are measured apart."""
    from megatron_pp_ext.runtime.trace import Tracer
    from megatron_pp_ext.schedules.ir import Op, OpKind

    tracer = Tracer(0)
    tracer.begin_iteration()
    tracer.add_comm_bytes(100)  # posted before op 0, consumed by op 1
    tracer.add_send_bytes(40)
    tracer.begin_op(Op(OpKind.F, 0, 0))
    tracer.end_op(Op(OpKind.F, 0, 0))
    tracer.add_comm_bytes(-100)
    tracer.add_send_bytes(-40)
    tracer.begin_op(Op(OpKind.F, 0, 1))
    tracer.end_op(Op(OpKind.F, 0, 1))
    tracer.end_iteration()
    last = tracer.iterations[-1]
    assert last["peak_activation_bytes"] == 100
    assert last["peak_pending_send_bytes"] == 40
    assert tracer.live_bytes() == 0
