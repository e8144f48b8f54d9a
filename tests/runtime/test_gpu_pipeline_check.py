"""The GPU check's pipeline check on CPU ranks: zb-h1 on 2 ranks with every message staged through host
buffers (the code that carries CUDA tensors over gloo on the GPU machine) against megatron's own 1F1B."""

from __future__ import annotations

from megatron_pp_ext.verification.gpu_check import pipeline


def test_pipeline_check_dry_run_passes_through_host_staging(pool):
    result = pipeline("cpu", True, pool=pool)
    assert result["status"] == "pass", result
    zb = result["details"]["zb-h1"]
    assert zb["ok"] and zb["problems"] == []
    assert zb["max_abs_loss_diff"] <= 1e-6 and zb["max_rel_grad_diff"] <= 1e-6
