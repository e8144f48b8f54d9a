"""Which transformer layers each local model chunk holds under a schedule's placement.

Pure Python (no torch, no megatron): the megatron integration and the verify
harness both build model chunks from this table, so layers keep their global
numbers whatever the placement (a checkpoint written under one placement loads
under another).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schedules.ir import ScheduleError
from ..schedules.placement import Placement


class LayerSplitError(ScheduleError):
    """The model's layers cannot be split into the placement's stages."""


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


@dataclass(frozen=True)
class LayerSplit:
    """Megatron's uneven pipeline splits, for any placement (slices in model order).

    ``first`` / ``last``: transformer layers of the first / last model slice
    (``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``);
    ``embedding`` / ``loss``: the embedding / the loss counts as one layer of the first / last
    slice (``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``).
    The remaining layers split evenly over the other slices.

    ``counts``: the transformer layers of every slice, given outright (a hybrid layer pattern's
    ``|`` segments, :mod:`.hybrid_pattern`); excludes the other fields.
    """

    first: int | None = None
    last: int | None = None
    embedding: bool = False
    loss: bool = False
    counts: tuple[int, ...] | None = None

    @property
    def even(self) -> bool:
        return self == LayerSplit()


def stage_layer_counts(num_layers: int, num_slices: int, split: LayerSplit | None = None) -> list[int]:
    """Transformer layers of each of ``num_slices`` model slices (even unless ``split`` says otherwise)."""
    if num_slices < 1:
        raise LayerSplitError(f"need at least one stage, got {num_slices}")
    split = split or LayerSplit()
    if split.counts is not None:
        if len(split.counts) != num_slices or sum(split.counts) != num_layers:
            raise LayerSplitError(
                f"{len(split.counts)} given stage layer counts ({sum(split.counts)} layers) do not fit the "
                f"placement's {num_slices} stages of {num_layers} layers"
            )
        return list(split.counts)
    if num_slices == 1:  # one stage holds the whole model (megatron ignores the options without PP)
        return [num_layers]
    if split.embedding or split.loss:
        if split.first is not None or split.last is not None:
            raise LayerSplitError(
                "--account-for-embedding/loss-in-pipeline-split cannot be combined with "
                "--decoder-first/last-pipeline-num-layers"
            )
        units = num_layers + int(split.embedding) + int(split.loss)
        if units % num_slices:
            raise LayerSplitError(
                f"--num-layers {num_layers} plus the embedding/loss counted as layers ({units}) does not split "
                f"evenly into the placement's {num_slices} stages (choose --num-layers so that the sum is a "
                f"multiple of {num_slices})"
            )
        counts = [units // num_slices] * num_slices
        counts[0] -= int(split.embedding)
        counts[-1] -= int(split.loss)
        if min(counts) < 0:
            raise LayerSplitError(f"--num-layers {num_layers} is too small for {num_slices} stages")
        return counts
    fixed = {0: split.first, num_slices - 1: split.last}
    fixed = {i: n for i, n in fixed.items() if n is not None}
    if any(n < 0 for n in fixed.values()):
        raise LayerSplitError("--decoder-first/last-pipeline-num-layers must be >= 0")
    rest = num_layers - sum(fixed.values())
    free = num_slices - len(fixed)
    if rest < 0 or (free == 0 and rest != 0) or (free and rest % free):
        flags = " and ".join(
            f"--decoder-{'first' if i == 0 else 'last'}-pipeline-num-layers {n}" for i, n in fixed.items()
        )
        raise LayerSplitError(
            f"--num-layers {num_layers} does not split evenly into the placement's {num_slices} stages"
            + (f" with {flags}" if flags else f" (choose a multiple of {num_slices})")
        )
    per = rest // free if free else 0
    return [fixed.get(i, per) for i in range(num_slices)]


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
