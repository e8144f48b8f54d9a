"""Tied input/output embeddings under any placement.

With ``share_embeddings_and_output_weights`` megatron keeps two copies of the
word embedding when the embedding (first stage) and the output layer (last
stage) live in different chunks, and all-reduces their gradients over the
"embedding group" of the first and last pipeline ranks. That is right for loop
placements (first stage on rank 0, last on rank P-1). When the placement puts
both ends of a replica on the same rank (V-shape: rank 0 holds stage 0 and stage
2P-1), the copies sit in two local chunks: their gradients are added locally and
megatron's cross-rank embedding all-reduce is switched off for this call. A last stage holding
multi-token prediction layers keeps a copy of the embedding for them, tied the same way with or without
``share_embeddings_and_output_weights`` (``runtime/mtp.py``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ..schedules.placement import Placement
from .mtp import holds_mtp_without_embedding


def ends_on_same_rank(placement: Placement) -> bool:
    """True when every replica's first and last stage sit on one rank."""
    return all(
        placement.rank_of(first) == placement.rank_of(first + placement.stages_per_replica - 1)
        for first in (placement.first_stage(r) for r in range(placement.num_replicas))
    )


def _unwrap(module: Any) -> Any:
    while hasattr(module, "module"):
        module = module.module
    return module


def _grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    return getattr(param, "main_grad", None) if hasattr(param, "main_grad") else param.grad


def local_tied_pairs(placement: Placement, rank: int, models: list[Any]) -> list[tuple[Any, Any]]:
    """(embedding weight, output weight) pairs of this rank whose two ends are both local."""
    pairs = []
    stages = placement.stages_on_rank(rank)
    for replica in range(placement.num_replicas):
        first = placement.first_stage(replica)
        last = first + placement.stages_per_replica - 1
        if first in stages and last in stages:
            head = _unwrap(models[stages.index(first)])
            tail = _unwrap(models[stages.index(last)])
            tied = getattr(head, "share_embeddings_and_output_weights", False) or holds_mtp_without_embedding(tail)
            if tied and head is not tail:
                pairs.append((head.shared_embedding_or_output_weight(), tail.shared_embedding_or_output_weight()))
    return pairs


class _NoPeers:
    """Stands for an embedding group with no other member: megatron skips its all-reduce.

    (``None`` would make megatron fall back to its default first/last-rank group.)
    """

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def without_embedding_groups(pg_collection: Any) -> Any:
    """A copy of ``pg_collection`` whose embedding groups megatron will skip."""
    clone = copy.copy(pg_collection)
    clone.embd = _NoPeers()
    if hasattr(clone, "pos_embd"):
        clone.pos_embd = _NoPeers()
    return clone


def add_local_tied_grads(pairs: list[tuple[Any, Any]]) -> None:
    """Both copies of each tied embedding get the sum of their gradients."""
    for a, b in pairs:
        ga, gb = _grad(a), _grad(b)
        if ga is None or gb is None:
            continue
        total = ga + gb
        ga.copy_(total)
        gb.copy_(total)
