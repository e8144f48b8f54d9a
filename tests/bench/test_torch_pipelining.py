"""torch.distributed.pipelining's runtime on our megatron chunks (the peer benchmark's third column)."""

from __future__ import annotations

import pytest

from megatron_pp_ext.bench import torch_pipelining
from megatron_pp_ext.verification.rank_pool import check_errors
from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec

pytestmark = pytest.mark.gloo


def test_torch_1f1b_and_ours_give_the_same_losses_on_the_same_chunks(pool):
    spec = torch_pipelining.TorchRunSpec("1f1b", 2, 4, 1, TinyGPTSpec(num_layers=2), iterations=2)
    results = pool.run_fn(torch_pipelining.run_on_rank, spec, 2, wall_timeout_s=600)
    check_errors(results)
    last = results[-1]  # the rank with the loss
    assert len(last["losses"]["torch"]) == 2 and len(last["losses"]["torch"][0]) == 4
    for theirs, ours in zip(last["losses"]["torch"], last["losses"]["ours"], strict=True):
        assert theirs == pytest.approx(ours, rel=1e-5)  # megatron's vocab-parallel CE vs F.cross_entropy
    assert all(r["peak_saved_bytes"]["torch"] > 0 and r["peak_saved_bytes"]["ours"] > 0 for r in results)
