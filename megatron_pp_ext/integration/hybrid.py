"""megatron-core's ``HybridModel`` built for the layers a schedule's placement gives a chunk, on CPU too.

Megatron's own hybrid stack spec (``hybrid_layer_specs.hybrid_stack_spec``) is made of Transformer
Engine modules, and its ``HybridStack`` builds the final norm as ``TENorm`` whatever the spec says;
neither exists without TE. :func:`local_hybrid_stack_spec` gives the same layer types from
megatron-core's local modules (the local GPT layer split into its attention half and its MLP half,
as megatron's hybrid spec splits the TE one), and :func:`use_local_final_norm` makes the stack's
final norm megatron's local layer norm where TE does not import.

Which layers a chunk builds: megatron's ``HybridModel`` asks ``select_pipeline_segment`` (segment
``vp_stage * p + pp_rank``). :func:`build_hybrid_model` builds a chunk whose layers were chosen by
the placement (:mod:`megatron_pp_ext.runtime.hybrid_pattern`); under ``pretrain()`` the layout hooks
(:mod:`.layout`) answer ``select_pipeline_segment`` from the placement the same way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

# The layer symbols the local spec builds (megatron's Mamba, GDN, DSA and MLA layers need TE or kernels).
LOCAL_SYMBOLS = "*-E"


def _transformer_engine_importable() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # not installed, or installed without its CUDA libraries
        return False
    return True


def use_local_final_norm() -> None:
    """``HybridStack``'s final norm as megatron's local layer norm when Transformer Engine is missing
    (megatron-core 0.19.2 builds it as ``TENorm``, which raises then). Idempotent."""
    if _transformer_engine_importable():
        return
    from megatron.core.models.hybrid import hybrid_block
    from megatron.core.transformer.transformer_block import LayerNormImpl

    hybrid_block.TENorm = LayerNormImpl  # type: ignore[attr-defined,misc]


def local_hybrid_stack_spec(num_experts: int | None = None) -> Any:
    """A ``HybridStack`` spec of megatron-core's local modules: ``*`` the local GPT layer's attention
    half, ``-`` its MLP half, ``E`` its MoE MLP (``num_experts`` experts, without grouped GEMM)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.ssm.mlp_layer import MLPLayer
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    dense = get_gpt_layer_local_submodules()
    attention = TransformerLayerSubmodules(
        input_layernorm=dense.input_layernorm, self_attention=dense.self_attention, self_attn_bda=dense.self_attn_bda
    )
    mlp = TransformerLayerSubmodules(pre_mlp_layernorm=dense.pre_mlp_layernorm, mlp=dense.mlp, mlp_bda=dense.mlp_bda)
    layers: dict[str, Any] = {
        "attention_layer": ModuleSpec(module=TransformerLayer, submodules=attention),
        "mlp_layer": ModuleSpec(module=MLPLayer, submodules=mlp),
    }
    if num_experts:
        sparse = get_gpt_layer_local_submodules(num_experts=num_experts, moe_grouped_gemm=False)
        moe = TransformerLayerSubmodules(
            pre_mlp_layernorm=sparse.pre_mlp_layernorm, mlp=sparse.mlp, mlp_bda=sparse.mlp_bda
        )
        layers["moe_layer"] = ModuleSpec(module=TransformerLayer, submodules=moe)
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(**layers, mtp_block_spec=_local_mtp_block()))


def _local_mtp_block() -> Any:
    """The MTP block of a pattern's ``/`` part, of local modules (megatron's hybrid spec has it of TE ones):
    each depth's norms and projection; its inner layers are built from the MTP pattern by megatron."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlock,
        MultiTokenPredictionBlockSubmodules,
        MultiTokenPredictionLayer,
        MultiTokenPredictionLayerSubmodules,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec

    local = LocalSpecProvider()
    norm = local.layer_norm()
    layer = MultiTokenPredictionLayerSubmodules(
        enorm=norm, hnorm=norm, eh_proj=local.column_parallel_linear(), mtp_model_layer=None, layer_norm=norm
    )
    return ModuleSpec(
        module=MultiTokenPredictionBlock,
        submodules=MultiTokenPredictionBlockSubmodules(
            layer_specs=[ModuleSpec(module=MultiTokenPredictionLayer, submodules=layer)]
        ),
    )


@contextlib.contextmanager
def chosen_segment(layer_types: list[str], layer_offset: int) -> Iterator[None]:
    """While a ``HybridModel`` is built: its layers are ``layer_types`` from global layer ``layer_offset``
    (instead of megatron's choice by pipeline rank and ``vp_stage``)."""
    from megatron.core.models.hybrid import hybrid_layer_allocation as allocation

    original = allocation.select_pipeline_segment

    def select(*args: Any, **kwargs: Any) -> tuple[list[str], int]:
        return list(layer_types), layer_offset

    allocation.select_pipeline_segment = select  # HybridModel imports it at construction
    try:
        yield
    finally:
        allocation.select_pipeline_segment = original


def build_hybrid_model(
    config: Any,
    layer_types: list[str],
    layer_offset: int,
    *,
    vocab_size: int,
    max_sequence_length: int,
    pre_process: bool,
    post_process: bool,
    share_embeddings_and_output_weights: bool,
    vp_stage: int | None,
    num_experts: int | None = None,
) -> Any:
    """One ``HybridModel`` chunk of the local spec holding ``layer_types`` (global layers from
    ``layer_offset``), with learned absolute positions (as the tiny GPT)."""
    from megatron.core.models.hybrid.hybrid_model import HybridModel

    use_local_final_norm()
    with chosen_segment(layer_types, layer_offset):
        return HybridModel(
            config=config,
            hybrid_stack_spec=local_hybrid_stack_spec(num_experts),
            vocab_size=vocab_size,
            max_sequence_length=max_sequence_length,
            hybrid_layer_pattern="".join(layer_types),
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=share_embeddings_and_output_weights,
            position_embedding_type="learned_absolute",
            vp_stage=vp_stage,
        )
