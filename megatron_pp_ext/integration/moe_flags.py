"""megatron's MoE flags against CPU mode and the plugin's schedules: the combinations that cannot run.

What runs: megatron's MoE layer with ``SequentialMLP`` experts (``ColumnParallelLinear`` /
``RowParallelLinear``), its top-k router with the load-balancing loss, the ``alltoall`` and
``allgather`` token dispatchers, expert parallelism (``--expert-model-parallel-size``) on gloo, under
megatron's own schedule and every ``--pipeline-schedule`` (docs/moe.md). Each check here raises
:class:`~.config.PipelineArgumentError` (one ``argument --flag: ...`` line) before any process group.
"""

from __future__ import annotations

from typing import Any

from .config import PipelineArgumentError


def _given(args: Any, name: str) -> bool:
    value = getattr(args, name, None)
    return value is not None and value is not False


def check_cpu(args: Any) -> None:
    """``--cpu`` with a MoE option that needs a GPU library."""
    if not getattr(args, "num_experts", None):
        return
    for attr, flag in (
        ("moe_grouped_gemm", "--moe-grouped-gemm"),
        ("moe_use_legacy_grouped_gemm", "--moe-use-legacy-grouped-gemm"),
    ):
        if _given(args, attr):
            raise PipelineArgumentError(
                flag,
                "not with --cpu: the grouped GEMM needs Transformer Engine (or the grouped_gemm package) on a "
                "GPU; CPU mode runs megatron's SequentialMLP experts (drop the flag)",
            )
    if getattr(args, "moe_token_dispatcher_type", None) == "flex":
        raise PipelineArgumentError(
            "--moe-token-dispatcher-type",
            "flex (DeepEP / HybridEP) is not with --cpu: use alltoall or allgather",
        )
    if _given(args, "moe_paged_stash"):
        raise PipelineArgumentError("--moe-paged-stash", "not with --cpu: its kernels need triton and CUDA")


def check_schedule(args: Any) -> None:
    """MoE options of megatron's own schedules next to ``--pipeline-schedule`` / ``--pipeline-schedule-file``."""
    if _given(args, "overlap_moe_expert_parallel_comm"):
        raise PipelineArgumentError(
            "--overlap-moe-expert-parallel-comm",
            "megatron's combined 1F1B schedule cannot run with --pipeline-schedule (dualpipev overlaps a "
            "micro-batch's all-to-all with another's backward instead)",
        )
    if _given(args, "delay_wgrad_compute"):
        raise PipelineArgumentError(
            "--delay-wgrad-compute",
            "megatron's weight-gradient delay belongs to its combined 1F1B schedule and is not with "
            "--pipeline-schedule: a schedule that splits the backward (zb-h1, zb-h2, v-zb, dualpipev, ...) "
            "defers the weight gradients itself",
        )
