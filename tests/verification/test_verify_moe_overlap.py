"""MoE all-to-all overlap through megatron's combined forward-backward step, on real gloo ranks.

EP = 2 x PP = 2 (4 ranks; the two data-parallel replicas share the experts): our executor runs every
forward, backward and overlap pair of the schedule's overlapped order (``analysis/overlap_order.py``) through megatron's
``combined_forward_backward_step``; losses and every gradient must match the references (which run
without overlap) within ``verify``'s criterion. The trace test reads the order of megatron's schedule
nodes on the host (CPU mode runs the communication-stream nodes on a worker thread,
``integration/cpu_streams.py``): each all-to-all node of a pair is launched, the other micro-batch's
compute runs, then the all-to-all is waited for.
"""

from __future__ import annotations

from typing import Any

import pytest

from megatron_pp_ext.analysis.overlap_order import overlap_order
from megatron_pp_ext.schedules import generate
from megatron_pp_ext.schedules.schedule import Schedule
from megatron_pp_ext.verification import criterion
from megatron_pp_ext.verification.compare import compare
from megatron_pp_ext.verification.rank_pool import check_errors
from megatron_pp_ext.verification.reference import reference_runs
from megatron_pp_ext.verification.run_spec import OURS, RunSpec
from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec
from megatron_pp_ext.verification.verify import verify_schedule

from .overlap_helpers import run_with_node_and_send_events, run_with_node_events

P, M = 2, 4
COMM_NODES = ("moe_dispatch", "moe_combine")


def moe_model(name: str) -> TinyGPTSpec:
    return TinyGPTSpec(num_layers=generate(name, P, M).placement.stages_per_replica, num_experts=4, moe_topk=2)


def overlapped_spec(name: str, schedule: Schedule, **extra: Any) -> RunSpec:
    """Our overlapped run of ``schedule`` on EP = 2 x PP = 2 with two data-parallel replicas."""
    return RunSpec(
        pp=P,
        num_microbatches=M,
        dp=2,
        ep=2,
        overlap_moe=True,
        mode=OURS,
        schedule_csv=schedule.to_csv(),
        model=moe_model(name),
        **extra,
    )


@pytest.mark.parametrize("name", ["1f1b", "dualpipev"])
def test_overlapped_moe_matches_the_references(pool, name: str) -> None:
    schedule = generate(name, P, M)
    report = verify_schedule(schedule, pool, model=moe_model(name), dp=2, ep=2, overlap_moe=True, iterations=1)
    assert report.problems == []
    assert report.ok, report.describe()


def _steps(events: list[tuple]) -> list[list[tuple]]:
    """The node events of each combined step, in order."""
    steps: list[list[tuple]] = []
    for event in events:
        if event[0] == "step":
            steps.append([event])
        elif steps:
            steps[-1].append(event)
    return steps


def test_v_zb_pairs_hide_each_all_to_all_behind_the_other_micro_batch(pool) -> None:
    """v-zb (W deferred to its own ops): per rank one combined step per marked pair; inside a pair every
    dispatch and combine all-to-all of both sides is launched before a compute node of the other
    micro-batch and waited for after it; losses and gradients match the references."""
    name, iterations = "v-zb", 1
    schedule = generate(name, P, M)
    spec = overlapped_spec(
        name, schedule, split_backward=True, iterations=iterations, adam_eps=criterion.ADAM_EPS, lr=criterion.LR
    )
    exact, ref = reference_runs(pool, spec)
    run = pool.run_fn(run_with_node_events, spec, spec.world_size, 300)
    check_errors(run)
    paired = overlap_order(schedule)  # what the executor runs
    for result in run:
        rank = result["pp_rank"]
        steps = _steps(result["node_events"])
        both = [s for s in steps if s[0][1] and s[0][2]]
        assert len(both) == len(paired.overlap_pairs[rank]) * iterations > 0
        hidden = 0
        for step in both:
            launches = [(k, e) for k, e in enumerate(step) if e[0] == "launch"]
            assert {e[1] for _, e in launches} == set(COMM_NODES)  # both sides' dispatch and combine
            for k, (_, node, side, serial) in launches:
                wait = next(j for j, e in enumerate(step) if e[0] == "wait" and e[3] == serial)
                beside = [e for e in step[k + 1 : wait] if e[0] == "compute" and e[2] != side]
                assert beside, (node, side, step)
                hidden += 1
        assert hidden > 0
        # split schedule: every B of the rank (paired or not) queued the weight gradients of its linears
        # (router, experts, attention, ...) for its W; megatron's own delay_wgrad_compute is off
        queued = result["wgrad_queued"]
        chunk_of = paired.placement.chunk_of
        assert set(queued) == {f"{chunk_of(op.stage)}.{op.microbatch}" for op in schedule.ops[rank] if op.kind == "B"}
        for chunk in {key.split(".")[0] for key in queued}:  # the same linears in every micro-batch of a chunk
            counts = {n for key, n in queued.items() if key.split(".")[0] == chunk}
            assert len(counts) == 1 and counts.pop() > 0, queued
    report = compare(name, P, M, 2, ref, run, exact=exact)
    assert report.problems == []
    assert report.ok, report.describe()


def test_a_pair_sends_its_forward_output_before_its_backward_ends(pool) -> None:
    """1f1b: in every combined step of a forward and a backward on the rank whose forward output goes to
    the other rank, that output's send is posted from inside the step (megatron's ``post_forward``):
    after the forward's last node and before the backward's last node."""
    name = "1f1b"
    schedule = generate(name, P, M)
    spec = overlapped_spec(name, schedule, iterations=1)
    run = pool.run_fn(run_with_node_and_send_events, spec, spec.world_size, 300)
    check_errors(run)
    checked = 0
    for result in run:
        if result["pp_rank"] != 0:  # the last stage sends no forward output
            continue
        for step in [s for s in _steps(result["node_events"]) if s[0][1] and s[0][2]]:
            sent = [k for k, e in enumerate(step) if e[0] == "send" and e[1] == "act"]
            assert len(sent) == 1, step
            # the forward's last node: its last all-to-all (combine), done at its first wait
            combine = max(e[3] for e in step if e[0] == "launch" and e[2] == "F")
            forward_end = next(k for k, e in enumerate(step) if e[0] == "wait" and e[3] == combine)
            backward_end = max(k for k, e in enumerate(step) if e[0] == "compute" and e[2] == "B")
            assert forward_end < sent[0] < backward_end, step
            checked += 1
    pairs = len(overlap_order(schedule).overlap_pairs[0])  # what the executor runs (its warm-up deepened)
    assert pairs >= 1
    assert checked == 2 * pairs  # every pair of rank 0, in both data-parallel replicas
