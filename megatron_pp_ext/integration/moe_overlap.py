"""``--overlap-moe-expert-parallel-comm`` with a plugin schedule: what megatron needs to let it through.

The executor reads megatron's flag from the model's config and then runs every forward, backward and
overlap pair through megatron's combined forward-backward step (``runtime/combined_step.py``); the
flag's other conditions are checked with the arguments (``moe_flags.check_overlap``). One condition of
megatron's ``TransformerConfig.__post_init__`` concerns only megatron's own schedule: with more than
one pipeline stage it demands virtual stages, because megatron's combined 1F1B exists only in its
interleaved schedule. Our schedules pair ops themselves (``schedules/pairs.py``), with one model chunk
per rank as well, so :func:`activate` lets a config with one chunk per rank through that check (and
only that one: the config keeps ``virtual_pipeline_model_parallel_size=None``).
"""

from __future__ import annotations

from typing import Any

from ._patching import Patcher

__all__ = ["activate"]


def activate(patcher: Patcher, args: Any) -> None:
    """With megatron's overlap flag in ``args``: TransformerConfig accepts it without virtual stages
    (undone with ``patcher``). Nothing otherwise."""
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
