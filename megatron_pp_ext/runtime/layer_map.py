"""Which transformer layers each local model chunk holds under a schedule's placement.

Pure Python (no torch, no megatron): the megatron integration and the verify
harness both build model chunks from this table, so layers keep their global
numbers whatever the placement (a checkpoint written under one placement loads
under another). The layer count of each model stage: :mod:`megatron_pp_ext.schedules.layer_split`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schedules.ir import ScheduleError
from ..schedules.layer_split import LayerSplit, stage_layer_counts
from ..schedules.placement import Placement

__all__ = ["ChunkLayout", "chunk_layouts"]


@dataclass(frozen=True)
class ChunkLayout:
    chunk: int  # local chunk index on this rank (index into the model list)
    stage: int  # global stage id
    model_slice: int  # 0 = embedding side ... stages_per_replica - 1 = loss side
    replica: int
    layer_offset: int  # global index of this chunk's first transformer layer
    num_layers: int
    pre_process: bool  # holds the embedding (first slice)
    post_process: bool  # holds the final norm, output layer and loss (last slice)


def chunk_layouts(
    placement: Placement, num_layers: int, rank: int, split: LayerSplit | None = None
) -> list[ChunkLayout]:
    """Layout of every local chunk of ``rank``, indexed by chunk."""
    if not 0 <= rank < placement.num_ranks:
        raise ScheduleError(f"rank {rank} not in 0..{placement.num_ranks - 1}")
    counts = stage_layer_counts(num_layers, placement.stages_per_replica, split)
    offsets = [sum(counts[:i]) for i in range(len(counts))]
    layouts = []
    for chunk, stage in enumerate(placement.stages_on_rank(rank)):
        s = placement.model_slice_of(stage)
        layouts.append(
            ChunkLayout(
                chunk=chunk,
                stage=stage,
                model_slice=s,
                replica=placement.replica_of(stage),
                layer_offset=offsets[s],
                num_layers=counts[s],
                pre_process=placement.is_first(stage),
                post_process=placement.is_last(stage),
            )
        )
    return layouts
