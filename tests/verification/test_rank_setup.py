"""A rank's process-group set-up (verification/rank_setup.py): everything it set up is gone after the block,
also when the block raised, so that the next job of a reused pool worker starts clean."""

from __future__ import annotations

from typing import Any

import pytest

from megatron_pp_ext.verification.rank_pool import check_errors
from megatron_pp_ext.verification.rank_setup import prepare_device, rank_process_group


def fail_inside(payload: Any, rank: int, init_method: str) -> dict[str, Any]:
    """On each of 2 ranks: a pipeline of 2 set up, an error raised inside the block; what was live
    inside and what is left after."""
    try:
        with rank_process_group(rank, 2, init_method, timeout_s=60.0, pp=2) as dist:
            from megatron.core import parallel_state as ps

            inside = [dist.is_initialized(), ps.get_pipeline_model_parallel_world_size()]
            raise RuntimeError("fails inside the block")
    except RuntimeError:
        pass
    return {"inside": inside, "after": [dist.is_initialized(), ps.model_parallel_is_initialized()]}


def test_groups_are_destroyed_when_the_block_raises(pool):
    results = pool.run_fn(fail_inside, None, 2, 300)
    check_errors(results)
    assert [r["inside"] for r in results] == [[True, 2], [True, 2]]
    assert [r["after"] for r in results] == [[False, False], [False, False]]


def test_unknown_device_is_refused():
    with pytest.raises(ValueError, match=r"device must be one of auto, cpu, cuda, none, got 'gpu'"):
        prepare_device("gpu")
