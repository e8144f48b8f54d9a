"""MoE models (megatron's MoE layer, SequentialMLP experts, top-2 routing with the load-balancing loss)
under our executor, against the references: losses and every gradient, router and experts included.

Expert parallelism: ``ep`` of the ``dp`` data-parallel ranks share the experts, tokens travel by the
all-to-all dispatcher over gloo. The load-balancing loss must be counted once per micro-batch as
megatron's ``forward_step`` scales it (``test_verify_breaks.py``: counted twice fails by far).
"""

from __future__ import annotations

import pytest

from megatron_pp_ext.schedules import generate
from megatron_pp_ext.verification import criterion
from megatron_pp_ext.verification.compare import compare
from megatron_pp_ext.verification.rank_pool import check_errors
from megatron_pp_ext.verification.reference import reference_runs
from megatron_pp_ext.verification.run_spec import OURS, RunSpec
from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec
from megatron_pp_ext.verification.verify import verify_schedule

from .overlap_helpers import run_with_moe_overlap

P, M = 2, 4


def moe_model(schedule_name: str) -> TinyGPTSpec:
    stages = generate(schedule_name, P, M).placement.stages_per_replica
    return TinyGPTSpec(num_layers=stages, num_experts=4, moe_topk=2)


def verify_moe(pool, name: str, ep: int):
    return verify_schedule(generate(name, P, M), pool, model=moe_model(name), dp=ep, ep=ep, iterations=2)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_moe_without_expert_parallelism(pool, name: str) -> None:
    report = verify_moe(pool, name, ep=1)
    assert report.problems == []
    assert report.ok, report.describe()
    if name == "1f1b":  # megatron's own order: bit for bit megatron's 1F1B
        assert report.bitwise_megatron_1f1b is True


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "v-zb", "dualpipev"])
def test_moe_with_expert_parallelism(pool, name: str) -> None:
    """EP = 2 x PP = 2 on 4 ranks (the experts split over the two data-parallel replicas)."""
    report = verify_moe(pool, name, ep=2)
    assert report.problems == []
    assert report.ok, report.describe()
    if name == "1f1b":
        assert report.bitwise_megatron_1f1b is True


def test_moe_requests_megatron_cannot_build_are_refused() -> None:
    with pytest.raises(ValueError, match="--dp 1 must be a multiple"):
        verify_schedule(generate("1f1b", P, M), model=moe_model("1f1b"), ep=2)
    with pytest.raises(ValueError, match="add --num-experts"):
        verify_schedule(generate("1f1b", P, M), model=TinyGPTSpec(num_layers=P), dp=2, ep=2)


def test_dualpipev_moe_overlap_hook_runs_the_backward_while_the_all_to_all_is_in_flight(pool) -> None:
    """DualPipeV at EP = 2 x PP = 2 with the MoE overlap hook on every chunk: in every pair the forward's
    first all-to-all is launched, the paired backward runs, then the all-to-all is waited for; the trace
    shows the backward inside the forward; losses and gradients still match the references."""
    name, m, iterations = "dualpipev", 5, 2
    schedule = generate(name, P, m)
    spec = RunSpec(
        pp=P,
        num_microbatches=m,
        dp=2,
        ep=2,
        mode=OURS,
        schedule_csv=schedule.to_csv(),
        split_backward=True,
        trace=True,
        model=moe_model(name),
        iterations=iterations,
        adam_eps=criterion.ADAM_EPS,
        lr=criterion.LR,
    )
    exact, ref = reference_runs(pool, spec)
    run = pool.run_fn(run_with_moe_overlap, spec, spec.world_size, 300)
    check_errors(run)
    for result in run:
        row = schedule.ops[result["pp_rank"]]
        pairs = [(row[i], row[i + 1]) for i in schedule.overlap_pairs[result["pp_rank"]]]
        assert pairs, "the schedule has no overlap pairs on this rank"
        expected = []
        for first, second in pairs:
            forward, backward = (first, second) if first.kind == "F" else (second, first)
            expected += [("a2a-launch", str(forward)), ("backward", str(backward)), ("a2a-wait", str(forward))]
        events = [e for chunk_events in result["moe_overlap_events"] for e in chunk_events]
        assert sorted(events) == sorted(expected * iterations)
        for chunk_events in result["moe_overlap_events"]:  # per chunk: launch, backward, wait, in that order
            for k in range(0, len(chunk_events), 3):
                kinds = [e[0] for e in chunk_events[k : k + 3]]
                assert kinds == ["a2a-launch", "backward", "a2a-wait"], chunk_events
        spans = {op: (start, end) for op, start, end in result["trace"]["last_iteration_ops"]}
        for first, second in pairs:  # the trace: the backward's span lies inside the forward's
            forward, backward = (first, second) if first.kind == "F" else (second, first)
            f, b = spans[str(forward)], spans[str(backward)]
            assert f[0] < b[0] <= b[1] < f[1], (forward, f, backward, b)
    report = compare(name, P, m, 2, ref, run, exact=exact)
    assert report.problems == []
    assert report.ok, report.describe()
