"""Megatron's multi-token prediction (MTP) layers as the runtime meets them.

A chunk holding MTP layers but not the embedding (``mtp_process`` and not ``pre_process``: the MTP layers sit
with the loss on the model's last stage) keeps its own copy of the word embeddings, which megatron ties to the
embedding stage's (zeroed at construction, all-reduced over the embedding group, gradients summed each step).
With ``share_embeddings_and_output_weights`` megatron computes that chunk's logits with this embedding copy
(``shared_embedding_or_output_weight``), so the chunk's ``output_layer.weight`` is allocated but never used:
it gets no gradient under any schedule, megatron's own included.
"""

from __future__ import annotations

from typing import Any


def unwrap(module: Any) -> Any:
    """The language model inside megatron's wrappers (DDP, Float16Module)."""
    while not hasattr(module, "shared_embedding_or_output_weight") and hasattr(module, "module"):
        module = module.module
    return module


def holds_mtp_without_embedding(module: Any) -> bool:
    """Whether ``module`` (a model chunk, wrapped or not) builds MTP layers but not the embedding stage."""
    model = unwrap(module)
    return bool(getattr(model, "mtp_process", False)) and not bool(getattr(model, "pre_process", True))


def unused_parameters(module: Any) -> set[int]:
    """``id()`` of the parameters of a chunk that megatron's forward never uses: the tied output layer's own
    weight on a chunk that computes its logits with its MTP embedding copy."""
    model = unwrap(module)
    if not (holds_mtp_without_embedding(model) and getattr(model, "share_embeddings_and_output_weights", False)):
        return set()
    output_layer = getattr(model, "output_layer", None)
    weight = getattr(output_layer, "weight", None)
    return set() if weight is None else {id(weight)}
