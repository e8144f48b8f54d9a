"""megatron's TransformerConfig with --overlap-moe-expert-parallel-comm under a plugin schedule
(integration/features/moe_layers.py): one chunk per rank is let through megatron's "virtual stages" check, and
only that check."""

from __future__ import annotations

import types
from typing import Any

import pytest

from megatron_pp_ext.integration._patching import Patcher
from megatron_pp_ext.integration.features.moe_layers import let_one_chunk_per_rank_through

OVERLAP = {
    "num_layers": 4,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "pipeline_model_parallel_size": 2,
    "num_moe_experts": 4,
    "expert_model_parallel_size": 2,
    "moe_token_dispatcher_type": "alltoall",
    "overlap_moe_expert_parallel_comm": True,
    "bf16": True,
}


def test_one_chunk_per_rank_passes_megatron_check_and_nothing_else(megatron: Any) -> None:
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = {**OVERLAP, "pipeline_dtype": torch.bfloat16}
    with pytest.raises(AssertionError, match="virtual_pipeline_model_parallel_size must be specified"):
        TransformerConfig(**kw)
    patcher = Patcher()
    let_one_chunk_per_rank_through(patcher, types.SimpleNamespace(overlap_moe_expert_parallel_comm=True))
    try:
        assert TransformerConfig(**kw).virtual_pipeline_model_parallel_size is None
        with pytest.raises(AssertionError, match="disable full recomputation"):  # megatron's other checks stay
            TransformerConfig(**kw, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    finally:
        patcher.restore()
    with pytest.raises(AssertionError, match="virtual_pipeline_model_parallel_size must be specified"):
        TransformerConfig(**kw)


def test_nothing_changes_without_the_flag(megatron: Any) -> None:
    from megatron.core.transformer.transformer_config import TransformerConfig

    original = TransformerConfig.__post_init__
    patcher = Patcher()
    let_one_chunk_per_rank_through(patcher, types.SimpleNamespace(overlap_moe_expert_parallel_comm=False))
    assert TransformerConfig.__post_init__ is original
    patcher.restore()
