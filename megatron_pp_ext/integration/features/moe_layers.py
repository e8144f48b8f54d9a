"""The MoE feature: megatron's mixture-of-experts layers under CPU mode and the plugin's schedules. The
combinations that cannot run are refused by :mod:`..moe_flags`' checks, which this adapter runs in the
features' order. With megatron's ``--overlap-moe-expert-parallel-comm`` the executor runs every F and B/BW
through megatron's combined step (:mod:`~megatron_pp_ext.runtime.combined_step`); the one patch is
:func:`let_one_chunk_per_rank_through` (megatron's config accepts the flag with one chunk per rank)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import moe_flags
from .base import Feature, Wiring, register

if TYPE_CHECKING:
    from .._patching import Patcher
    from ..config import PipelineConfig


class MoeLayers(Feature):
    name = "moe"
    megatron_flags = (
        "--moe-grouped-gemm",
        "--moe-use-legacy-grouped-gemm",
        "--moe-token-dispatcher-type",
        "--moe-paged-stash",
        "--overlap-moe-expert-parallel-comm",
        "--delay-wgrad-compute",
    )

    def check(self, args: Any, config: PipelineConfig) -> None:
        if getattr(args, "cpu", False):
            moe_flags.check_cpu(args)
        if config.selected:
            moe_flags.check_schedule(args)

    def activate(self, config: PipelineConfig, patcher: Patcher, wiring: Wiring) -> None:
        let_one_chunk_per_rank_through(patcher, wiring.megatron_args())


def let_one_chunk_per_rank_through(patcher: Patcher, args: Any) -> None:
    """With megatron's overlap flag in ``args``: megatron's ``TransformerConfig.__post_init__`` demands virtual
    stages with more than one pipeline stage (its combined 1F1B exists only in its interleaved schedule); our
    schedules pair ops themselves (``schedules/pairs.py``), with one chunk per rank as well, so that one check
    lets such a config through (it keeps ``virtual_pipeline_model_parallel_size=None``; undone with
    ``patcher``). Nothing otherwise."""
    if not getattr(args, "overlap_moe_expert_parallel_comm", False):
        return
    from megatron.core.transformer.transformer_config import TransformerConfig

    original = TransformerConfig.__post_init__

    def post_init(self: Any) -> None:
        chunkless = (
            self.overlap_moe_expert_parallel_comm
            and self.pipeline_model_parallel_size > 1
            and self.virtual_pipeline_model_parallel_size is None
        )
        if not chunkless:
            original(self)
            return
        self.virtual_pipeline_model_parallel_size = 1  # megatron's check only; restored below
        try:
            original(self)
        finally:
            self.virtual_pipeline_model_parallel_size = None

    TransformerConfig.__post_init__ = post_init
    patcher.on_restore(lambda: setattr(TransformerConfig, "__post_init__", original))


register(MoeLayers())
