"""The rank pool's own machinery (verification/rank_pool.py): warm workers and the runs' rendezvous."""

from __future__ import annotations

from typing import Any

import pytest

from megatron_pp_ext.verification.rank_pool import SCHEME, check_errors
from megatron_pp_ext.verification.rank_run import TrainingRankPool
from megatron_pp_ext.verification.rank_setup import rank_process_group
from tests.warm_pool import WARM_MODULE


def first_job(_payload: Any, rank: int, init_method: str) -> dict[str, Any]:
    """What a fresh worker holds at its first job, and a process group through the run's rendezvous."""
    import gc
    import sys

    import torch

    from megatron_pp_ext.integration import cpu

    before = {
        "megatron imported": "megatron.core.models.gpt" in sys.modules,
        "cpu shims": cpu.is_enabled(),
        "imports frozen": gc.get_freeze_count() > 0,
    }
    with rank_process_group(rank, 2, init_method, timeout_s=60.0, device="cpu") as dist:
        total = torch.tensor([rank + 1])
        dist.all_reduce(total)
    return {**before, "init_method": init_method, "sum": int(total)}


@pytest.mark.gloo
def test_warm_workers_start_set_up_and_meet_at_the_drivers_store():
    """A warm pool's fresh workers have imported megatron and installed the CPU shims before their first job
    (forked from the fork server of warm_rank.py), with those imports out of the cycle collector's way; the
    ranks' group is built through the store server the driver started for the run (``rankpool://``)."""
    with TrainingRankPool(2, warm_module=WARM_MODULE) as pool:
        results = pool.run_fn(first_job, None, 2, 120)
    check_errors(results)
    for result in results:
        assert result["megatron imported"] and result["cpu shims"] and result["imports frozen"], result
        assert result["init_method"].startswith(f"{SCHEME}://127.0.0.1:"), result
        assert result["sum"] == 3, result
