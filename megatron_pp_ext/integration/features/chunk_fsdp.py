"""The FSDP feature: ``--pipeline-fsdp``'s checks of megatron's flags (what per-chunk FSDP cannot train)
and its activation (:mod:`..fsdp_training` replaces megatron DDP and optimizer).

The checks are kept apart from the training code (which needs torch and megatron) so that flag
validation runs them before any process group exists, one ``argument --flag: ...`` line each.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from ..config import FSDP_FLAG, PipelineArgumentError
from .base import Feature, Wiring, register

if TYPE_CHECKING:
    from .._patching import Patcher
    from ..config import PipelineConfig

FLAG = FSDP_FLAG

# (megatron attribute, the flag the message names, refused when, message) under --pipeline-fsdp
_NOT_WITH = f"not allowed with {FLAG}"
_PLUGIN_FSDP = (
    f"{_NOT_WITH}, which is the FSDP of plugin schedules (megatron's FSDP gathers and reduces from module hooks, "
    "where the schedule cannot place them)"
)
_FP32 = f"{_NOT_WITH} yet (fp32 training only for now)"
_NO_CKPT = f"{_NOT_WITH} yet: checkpoints of FSDP shards are not implemented"
_REFUSED: tuple[tuple[str, str, Callable[[Any], bool], str], ...] = (
    ("use_distributed_optimizer", "--use-distributed-optimizer", bool,
     f"{_NOT_WITH}: FSDP shards gradients and optimizer state itself"),
    ("use_torch_fsdp2", "--use-torch-fsdp2", bool, _PLUGIN_FSDP),
    ("use_megatron_fsdp", "--use-megatron-fsdp", bool, _PLUGIN_FSDP),
    ("untie_embeddings_and_output_weights", FLAG, lambda v: not v,
     "tied embeddings are not supported under FSDP yet: add --untie-embeddings-and-output-weights"),
    ("tensor_model_parallel_size", "--tensor-model-parallel-size", lambda v: (v or 1) > 1, f"{_NOT_WITH} yet (TP=1)"),
    ("context_parallel_size", "--context-parallel-size", lambda v: (v or 1) > 1, f"{_NOT_WITH} yet (CP=1)"),
    ("num_experts", "--num-experts", bool, f"{_NOT_WITH} yet (no MoE)"),
    ("fp16", "--fp16", bool, _FP32),
    ("bf16", "--bf16", bool, _FP32),
    ("optimizer", "--optimizer", lambda v: v not in (None, "adam"), f"{_NOT_WITH}: only adam is implemented on shards"),
    ("decoupled_lr", "--decoupled-lr", lambda v: v is not None, f"{_NOT_WITH} yet (one learning rate)"),
    ("apply_wd_to_qk_layernorm", "--apply-wd-to-qk-layernorm", bool, f"{_NOT_WITH} yet (classic weight-decay rule)"),
    ("calculate_per_token_loss", "--calculate-per-token-loss", bool, f"{_NOT_WITH} yet"),
    ("log_params_norm", "--log-params-norm", bool, f"{_NOT_WITH}: full weights exist only while a chunk is gathered"),
    ("save", "--save", lambda v: v is not None, _NO_CKPT),
    ("load", "--load", lambda v: v is not None, _NO_CKPT),
)  # fmt: skip
# Refused from the command line before megatron's own validation, which rejects them with a traceback.
_ARGV_REFUSED = ("--use-torch-fsdp2", "--use-megatron-fsdp")


def check_arguments(args: Any) -> None:
    """Refuse flag combinations ``--pipeline-fsdp`` cannot train (raises :class:`PipelineArgumentError`)."""
    limit = getattr(args, "pipeline_fsdp_max_unsharded", None)
    if not getattr(args, "pipeline_fsdp", False):
        if limit is not None:
            raise PipelineArgumentError("--pipeline-fsdp-max-unsharded", f"needs {FLAG}")
        return
    if limit is not None and limit < 1:
        raise PipelineArgumentError("--pipeline-fsdp-max-unsharded", f"must be >= 1 (gathered chunks), got {limit}")
    for attr, flag, refused, message in _REFUSED:
        if refused(getattr(args, attr, None)):
            raise PipelineArgumentError(flag, message)


def check_argv(argv: Sequence[str]) -> None:
    """Before megatron parses ``argv``: refuse megatron's FSDP flags next to ``--pipeline-fsdp``."""
    if FLAG not in argv:
        return
    for flag in _ARGV_REFUSED:
        if any(a == flag or a.startswith(flag + "=") for a in argv):
            raise PipelineArgumentError(flag, _PLUGIN_FSDP)


class ChunkFsdp(Feature):
    """``--pipeline-fsdp``: per-chunk FSDP instead of megatron DDP (:mod:`..fsdp_training`)."""

    name = "fsdp"
    fields = ("fsdp", "fsdp_max_unsharded")
    megatron_flags = tuple(dict.fromkeys(flag for _, flag, _, _ in _REFUSED))

    def check(self, args: Any, config: PipelineConfig) -> None:
        if config.selected:
            check_arguments(args)

    def prepare(self, wiring: Wiring) -> None:
        config = wiring.config
        wiring.executor_options["fsdp_max_unsharded"] = config.fsdp_max_unsharded if config.fsdp else None

    def activate(self, config: PipelineConfig, patcher: Patcher, wiring: Wiring) -> None:
        if config.fsdp:
            from ..fsdp_training import patch_megatron

            patch_megatron(patcher)


register(ChunkFsdp())
