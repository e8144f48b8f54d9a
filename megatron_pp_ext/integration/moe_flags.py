"""megatron's MoE flags against CPU mode and the plugin's schedules: the combinations that cannot run.

What runs: megatron's MoE layer with ``SequentialMLP`` experts (``ColumnParallelLinear`` /
``RowParallelLinear``), its top-k router with the load-balancing loss, the ``alltoall`` and
``allgather`` token dispatchers, expert parallelism (``--expert-model-parallel-size``) on gloo, under
megatron's own schedule and every ``--pipeline-schedule`` (docs/moe.md); megatron's
``--overlap-moe-expert-parallel-comm`` with every schedule that pairs a forward with another micro-batch's
backward (:func:`check_overlap`: megatron's own conditions, quoted). Each check here raises
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
        check_overlap(args)
    if _given(args, "delay_wgrad_compute"):
        raise PipelineArgumentError(
            "--delay-wgrad-compute",
            "megatron's weight-gradient delay belongs to its combined 1F1B schedule and is not with "
            "--pipeline-schedule: a schedule that splits the backward (zb-h1, zb-h2, v-zb, dualpipev, ...) "
            "defers the weight gradients itself",
        )


#: megatron-core 0.19.2's own conditions for ``overlap_moe_expert_parallel_comm`` (TransformerConfig's
#: ``__post_init__``), each as (attribute, test of its value that refuses, flag, megatron's reason). Its
#: "virtual stages when PP > 1" is megatron's schedule's need, not ours: our schedules pair ops themselves.
_MEGATRON_REFUSES: tuple[tuple[str, Any, str, str], ...] = (
    ("expert_model_parallel_size", lambda v: (v or 1) <= 1, "--expert-model-parallel-size",
     "overlap_moe_expert_parallel_comm is only supported with expert model parallelism"),
    ("moe_token_dispatcher_type", lambda v: v not in ("alltoall", "flex"), "--moe-token-dispatcher-type",
     "overlap_moe_expert_parallel_comm is supported with alltoall/flex token dispatcher"),
    ("recompute_granularity", lambda v: v == "full", "--recompute-granularity",
     "disable full recomputation when enabling overlap_moe_expert_parallel_comm"),
    ("recompute_method", lambda v: v is not None, "--recompute-method",
     "disable recomputation method when enabling overlap_moe_expert_parallel_comm"),
    ("recompute_num_layers", lambda v: v is not None, "--recompute-num-layers",
     "recompute_num_layers must be None when enabling overlap_moe_expert_parallel_comm"),
    ("recompute_modules", lambda v: "moe" in (v or ()), "--recompute-modules",
     "disable moe in recompute_modules when enabling overlap_moe_expert_parallel_comm"),
    ("moe_shared_expert_overlap", bool, "--moe-shared-expert-overlap",
     "disable moe_shared_expert_overlap when enabling overlap_moe_expert_parallel_comm"),
    ("mtp_num_layers", lambda v: v not in (None, 0, 1), "--mtp-num-layers",
     "MTP supports at most one layer when enabling overlap_moe_expert_parallel_comm"),
)  # fmt: skip


def check_overlap(args: Any) -> None:
    """``--overlap-moe-expert-parallel-comm`` with a plugin schedule: megatron's own refusals (its reason,
    quoted), a model neither bf16 nor fp16 (megatron's too), and a schedule without overlap pairs."""
    for attr, refuses, flag, reason in _MEGATRON_REFUSES:
        if refuses(getattr(args, attr, None)):
            raise PipelineArgumentError(flag, f"not with --overlap-moe-expert-parallel-comm (megatron: {reason})")
    if not (_given(args, "bf16") or _given(args, "fp16")):
        raise PipelineArgumentError(
            "--overlap-moe-expert-parallel-comm",
            "needs --bf16 or --fp16 (megatron: overlap_moe_expert_parallel_comm is only supported with bf16 or "
            "fp16 model)",
        )
    name = getattr(args, "pipeline_schedule", None)
    p = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    if name and name != "auto" and p > 1 and not has_steady_pairs(name, p):
        raise PipelineArgumentError(
            "--overlap-moe-expert-parallel-comm",
            f"{name} on {p} ranks runs no steady state of forwards next to other micro-batches' backwards (at "
            "most one such pair per rank), so there is nothing to overlap: use 1f1b, interleaved-1f1b, zb-h1, "
            "v-zb, dualpipev, ...",
        )


def has_steady_pairs(name: str, p: int) -> bool:
    """Whether the registered schedule ``name`` on ``p`` ranks has a steady state of overlap pairs (some
    rank holds two or more at ``4p`` micro-batches); True when it cannot be built here (its own checks
    report that)."""
    from ..analysis.overlap_order import overlap_order
    from ..schedules import registry
    from ..schedules.ir import ScheduleError

    try:
        schedule = overlap_order(registry.generate(name, p, 4 * p))
    except (ScheduleError, ValueError):
        return True
    return max((len(row) for row in schedule.overlap_pairs), default=0) >= 2
