"""Why the GPU checks cannot run here (None: they can)."""

from __future__ import annotations


def skip_reason(min_gpus: int = 1) -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "needs CUDA (no GPU visible): run `bash scripts/run_gpu_tests.sh` on a CUDA machine"
    if torch.cuda.device_count() < min_gpus:
        return f"needs {min_gpus} GPUs, found {torch.cuda.device_count()}"
    from megatron_pp_ext.runtime.te_wgrad import te_support_problem

    problem = te_support_problem()
    if problem is not None:
        return f"needs a Transformer Engine that can split the backward: {problem}"
    return None
