"""The V-shape schedules at p=8 on real gloo ranks (p=8 is the largest shape that fits the test budget).

One warm pool of 8 rank processes for this module (the session pool has 4).
"""

from __future__ import annotations

import pytest

from megatron_pp_ext.schedules import generate
from megatron_pp_ext.verification.rank_run import TrainingRankPool
from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec
from megatron_pp_ext.verification.verify import verify_schedule
from tests.tiers import launches_ranks
from tests.warm_pool import WARM_MODULE


@pytest.fixture(scope="module")
@launches_ranks
def pool8():
    with TrainingRankPool(8, warm_module=WARM_MODULE) as ranks:
        yield ranks


@pytest.mark.parametrize(("name", "m"), [("v-zb", 16), ("v-half", 8), ("v-min", 8)])
def test_v_schedules_at_p8_match_reference(pool8, name, m):
    """Every V generator's order at eight ranks; v-zb with m = 2p (its steady state), the two
    memory-controlled shapes at m = p (their warm-up and cool-down are what differs from v-zb)."""
    p = 8
    schedule = generate(name, p, m)
    report = verify_schedule(schedule, pool8, model=TinyGPTSpec(num_layers=2 * p), iterations=2)
    assert report.problems == []
    assert report.ok, report


@pytest.mark.parametrize(
    ("dist_opt", "fsdp"), [(False, False), (True, False), (False, True)], ids=["ddp", "distributed-optimizer", "fsdp"]
)
def test_bfs_p4_dp2_matches_reference(pool8, dist_opt, fsdp):
    """Breadth-first at p=4, v=2 on 4 x 2 data-parallel ranks (the second data-parallel shape). Two iterations:
    the second runs on the stepped weights (with the distributed optimizer, on parameters gathered during its
    forward); the FSDP case shares its references with the ZeroPP cases below (same model, data and steps)."""
    schedule = generate("bfs", 4, 8, v=2)
    model = TinyGPTSpec(num_layers=8, tied_embeddings=not fsdp)
    report = verify_schedule(
        schedule, pool8, model=model, dp=2, distributed_optimizer=dist_opt, fsdp=fsdp, iterations=2
    )
    assert report.problems == []
    assert report.ok, report
    for launches in report.collectives:  # the later chunk's reduction overlaps the earlier chunk's backwards
        assert next(x for x in launches if x.startswith("reduce-grads")).endswith("(overlaps backward)")
    if fsdp:
        assert [info["derived_unshards"] for info in report.fsdp] == [3, 3, 3, 3]


@pytest.mark.parametrize("unit", [1, 2, 8])
def test_zeropp_p4_dp2_fsdp_matches_reference(pool8, unit):
    """ZeroPP at p=4, v=2 on 4 x 2 ranks with FSDP, one gathered chunk (so the per-unit gathers show):
    gathers and gradient reduce-scatters per iteration as the lowering derives (the second FSDP shape;
    U = 1, 2, m)."""
    from megatron_pp_ext.schedules.collectives import CollectiveKind, derive_collectives, policy_for

    schedule = generate("zeropp", 4, 8, v=2, unit_size=unit)
    model = TinyGPTSpec(num_layers=8, tied_embeddings=False)
    report = verify_schedule(schedule, pool8, model=model, dp=2, fsdp=True, fsdp_max_unsharded=1, iterations=2)
    assert report.problems == []
    assert report.ok, report
    plan = derive_collectives(schedule, policy_for(schedule, fsdp=True, fsdp_max_unsharded=1))
    derived = [plan.count(CollectiveKind.UNSHARD, r) for r in range(4)]
    assert [info["derived_unshards"] for info in report.fsdp] == derived
    assert all(info["all_gathers_per_iteration"] == [info["derived_unshards"]] * 2 for info in report.fsdp)
    # gradients reduce-scattered once per chunk and unit: v ceil(m/U), counted by the chunks and the trace
    reduces = [plan.count(CollectiveKind.REDUCE_GRADS, r) for r in range(4)]
    assert reduces == [2 * -(-8 // unit)] * 4
    for info in report.fsdp:
        assert info["derived_reduce_scatters"] == reduces[0]
        assert info["reduce_scatters_per_iteration"] == info["traced_reduce_scatters_per_iteration"] == [reduces[0]] * 2
