"""BitPipe on real gloo ranks: four chunks per rank, two replicas from identical weights, losses on two
ranks, tied embeddings added locally, the two copies' gradients summed (replica sync).

The executor does not run the schedule's ``replica-sync`` collectives yet; until it does (and marks
its function ``syncs_replicas = True``), ``verify`` sums the copies after each iteration
(:func:`megatron_pp_ext.runtime.replica_sync.sync_all`).
"""

from __future__ import annotations

import pytest

from megatron_pp_ext.schedules import generate
from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec
from megatron_pp_ext.verification.verify import verify_schedule


@pytest.mark.parametrize(("name", "p", "m"), [("bitpipe", 2, 4), ("bitpipe-zb", 2, 4), ("bitpipe", 4, 8)])
def test_bitpipe_matches_reference(pool, name, p, m):
    schedule = generate(name, p, m)
    report = verify_schedule(schedule, pool, model=TinyGPTSpec(num_layers=2 * p), iterations=3)
    assert report.problems == []  # includes: every replica copy bitwise equal to the other after 3 steps
    assert report.ok, report
    assert len(report.losses) == 3
