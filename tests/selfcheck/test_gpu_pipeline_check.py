"""The GPU check's pipeline check on CPU ranks: messages staged through host buffers (the code that carries
CUDA tensors over gloo on the GPU machine), and zb-h1 run that way against megatron's own 1F1B."""

from __future__ import annotations

from typing import Any

from megatron_pp_ext.selfcheck.gpu_check import pipeline
from megatron_pp_ext.verification.rank_pool import check_errors
from megatron_pp_ext.verification.rank_setup import rank_process_group


def exchange(payload: Any, rank: int, init_method: str) -> dict[str, Any]:
    """On each of 2 ranks: one staged batch that sends this rank's values and receives the other's."""
    import torch

    from megatron_pp_ext.verification import host_staging

    try:
        with rank_process_group(
            rank, 2, init_method, timeout_s=60.0, device="cpu", stage_p2p_through_host=True
        ) as dist:
            sent = torch.arange(6, dtype=torch.float32) + 10 * rank
            received = torch.zeros(6, requires_grad=True)  # like the executor's activation buffers
            works = dist.batch_isend_irecv(
                [dist.P2POp(dist.isend, sent, 1 - rank), dist.P2POp(dist.irecv, received, 1 - rank)]
            )
            for work in works:
                work.wait()
            # megatron DDP's reduction over a data-parallel group of one rank, inside a coalescing manager (gloo
            # refuses the coalesced all-reduce of CUDA tensors): returns at once, the tensor unchanged
            solo = [dist.new_group([0]), dist.new_group([1])][rank]
            grads = torch.full((3,), 2.0)
            with dist._coalescing_manager(solo):
                skipped = dist.all_reduce(grads, group=solo) is None
            return {
                "kinds": [type(w).__name__ for w in works],
                "received": received.detach().tolist(),
                "solo_reduce": (skipped, grads.tolist()),
            }
    finally:
        host_staging.uninstall()


def test_staged_messages_arrive(pool):
    results = pool.run_fn(exchange, None, 2, 300)
    check_errors(results)
    for rank, result in enumerate(results):
        assert result["kinds"] == ["_StagedSend", "_StagedRecv"]  # the staging path, not gloo's own
        assert result["received"] == [float(x + 10 * (1 - rank)) for x in range(6)]
        assert result["solo_reduce"] == (True, [2.0, 2.0, 2.0])


def test_pipeline_check_dry_run_passes_through_host_staging(pool):
    result = pipeline("cpu", True, pool=pool)
    assert result["status"] == "pass", result
    zb = result["details"]["zb-h1"]
    assert zb["ok"] and zb["problems"] == []
    assert zb["verdict"].startswith("derived criterion: "), zb["verdict"]  # not a fixed tolerance
