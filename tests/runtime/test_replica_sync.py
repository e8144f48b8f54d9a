"""runtime/replica_sync.py on real gloo ranks: mirror-pair groups, per-chunk sums at the plan's gaps."""

from __future__ import annotations

import pytest

from megatron_pp_ext.schedules import generate
from megatron_pp_ext.selfcheck.replica_sync_check import replica_sync_check
from megatron_pp_ext.verification.rank_pool import check_errors


@pytest.mark.parametrize("case", [("bitpipe", 4, 8), ("bitpipe-zb", 2, 4)])
def test_replica_syncer_sums_mirror_copies_at_the_plan_gaps(pool, case):
    name, p, m = case
    results = pool.run_fn(replica_sync_check, case, p, 120)
    check_errors(results)
    placement = generate(name, p, m).placement
    for rank, result in enumerate(results):
        mirror = p - 1 - rank
        mirror_chunk = {placement.model_slice_of(s): c for c, s in enumerate(placement.stages_on_rank(mirror))}
        for chunk, stage in enumerate(placement.stages_on_rank(rank)):
            other = mirror_chunk[placement.model_slice_of(stage)]
            for i, got in enumerate(result["grads"][chunk]):
                assert got == (100 * rank + 10 * chunk + i) + (100 * mirror + 10 * other + i), (rank, chunk, i)
        assert sorted(s for _, s in result["issued"]) == sorted(placement.stages_on_rank(rank))
    # eager: the edge ranks start the second-half chunks' syncs (chunks 2, 3) before their last op
    early = {placement.chunk_of(s) for gap, s in results[0]["issued"] if gap < results[0]["num_ops"]}
    assert {2, 3} <= early
