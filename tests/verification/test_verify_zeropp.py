"""ZeroPP on real gloo ranks (p=2 x dp=2, the session pool of 4): loss and every gradient match the
unpartitioned reference for U = 1, 2, 4, with FSDP (the per-chunk ShardedChunk of runtime/fsdp.py,
gathered and freed where the lowering derives: the measured all-gathers per iteration equal the derived
count), with plain data parallelism and with the distributed optimizer."""

from __future__ import annotations

import pytest

from megatron_pp_ext.analysis.fsdp_memory import fsdp_buffer_peaks
from megatron_pp_ext.schedules import generate
from megatron_pp_ext.schedules.collectives import CollectiveKind, declared_fsdp_limit, derive_collectives, policy_for
from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec
from megatron_pp_ext.verification.verify import verify_schedule

UNTIED = TinyGPTSpec(num_layers=4, tied_embeddings=False)


def derived(schedule, limit, kind=CollectiveKind.UNSHARD):  # type: ignore[no-untyped-def]
    plan = derive_collectives(schedule, policy_for(schedule, fsdp=True, fsdp_max_unsharded=limit))
    return [plan.count(kind, r) for r in range(schedule.num_ranks)]


@pytest.mark.parametrize("limit", [None, 1])  # the declared limit (2: every chunk stays gathered) and 1
@pytest.mark.parametrize("unit", [1, 2, 4])
def test_fsdp_matches_reference_and_gathers_as_derived(pool, unit, limit):
    schedule = generate("zeropp", 2, 4, v=2, unit_size=unit)
    limit = limit or declared_fsdp_limit(schedule)
    # two iterations: the gathers and reduce-scatters of each, and the second on the stepped weights (a third
    # repeats both); the references are those of the other FSDP tests at m = 4 here
    report = verify_schedule(schedule, pool, model=UNTIED, dp=2, fsdp=True, fsdp_max_unsharded=limit, iterations=2)
    assert report.ok, report.problems or (report.max_rel_grad_diff, report.max_abs_loss_diff)
    gathers = derived(schedule, limit)
    assert [info["derived_unshards"] for info in report.fsdp] == gathers
    # gradients reduce-scattered once per chunk and unit (the lowering's count: v ceil(m/U) per rank), counted
    # by the chunks and by the executor's trace
    reduces = derived(schedule, limit, CollectiveKind.REDUCE_GRADS)
    assert reduces == [2 * -(-4 // unit)] * 2
    assert [info["derived_reduce_scatters"] for info in report.fsdp] == reduces
    for info in report.fsdp:
        assert info["all_gathers_per_iteration"] == [info["derived_unshards"]] * report.iterations
        assert info["reduce_scatters_per_iteration"] == [info["derived_reduce_scatters"]] * report.iterations
        assert info["traced_reduce_scatters_per_iteration"] == [info["derived_reduce_scatters"]] * report.iterations
        # the memory model's gathered parameters: the `limit` largest chunks at once, measured by ShardedChunk
        chunks = sorted(info["full_param_bytes_per_chunk"], reverse=True)
        assert info["peak_bytes"]["full_params"] == sum(chunks[:limit])
    # the lowering's buffer model (analysis/fsdp_memory.py): gathered parameters exactly; the gradient buffers
    # the runtime frees once a reduce-scatter completed, so at least the model's (which holds every chunk here)
    placement = schedule.placement
    sizes = [
        float(report.fsdp[placement.rank_of(s)]["full_param_bytes_per_chunk"][placement.chunk_of(s)])
        for s in range(schedule.num_stages)
    ]
    plan = derive_collectives(schedule, policy_for(schedule, fsdp=True, fsdp_max_unsharded=limit))
    model = fsdp_buffer_peaks(plan, sizes)  # the tiny model is fp32: gradient buffers have the parameters' size
    for rank, info in enumerate(report.fsdp):
        assert info["peak_bytes"]["full_params"] == model.params[rank]
        assert info["peak_bytes"]["full_grads"] == model.grads[rank] == sum(info["full_param_bytes_per_chunk"])
    if limit == 2:
        assert gathers == [2, 2]  # v = 2 with two gathered chunks: each chunk gathered once per iteration


@pytest.mark.parametrize("dist_opt", [False, True])
def test_data_parallel_matches_reference(pool, dist_opt):
    schedule = generate("zeropp", 2, 4, v=2, unit_size=2)
    report = verify_schedule(schedule, pool, dp=2, distributed_optimizer=dist_opt)
    assert report.ok, report.problems or (report.max_rel_grad_diff, report.max_abs_loss_diff)
    for rank, launches in enumerate(report.collectives):
        assert sum(x.startswith("reduce-grads") for x in launches) == 2, (rank, launches)


def test_fsdp_unit_not_dividing_m(pool):
    """m = 5, U = 2: units of 2, 2 and 1 micro-batches, each chunk reduce-scattered three times."""
    schedule = generate("zeropp", 2, 5, v=2, unit_size=2)
    report = verify_schedule(schedule, pool, model=UNTIED, dp=2, fsdp=True, fsdp_max_unsharded=1, iterations=2)
    assert report.ok, report.problems or (report.max_rel_grad_diff, report.max_abs_loss_diff)
    for info in report.fsdp:
        assert info["derived_reduce_scatters"] == 6
        assert info["reduce_scatters_per_iteration"] == info["traced_reduce_scatters_per_iteration"] == [6, 6]


def test_fsdp_reduce_once_per_iteration_on_request(pool):
    """fsdp_grad_reduce_unit = m overrides the declared per-unit reduction (U = 1): one reduce-scatter per chunk."""
    schedule = generate("zeropp", 2, 4, v=2, unit_size=1)
    report = verify_schedule(
        schedule, pool, model=UNTIED, dp=2, fsdp=True, fsdp_max_unsharded=1, fsdp_grad_reduce_unit=4, iterations=2
    )
    assert report.ok, report.problems or (report.max_rel_grad_diff, report.max_abs_loss_diff)
    assert [info["derived_reduce_scatters"] for info in report.fsdp] == [2, 2]
    assert all(info["reduce_scatters_per_iteration"] == [2, 2] for info in report.fsdp)
