"""Which layers each rank's model chunks held when a ``--ckpt-format torch`` checkpoint was saved.

A torch-format checkpoint is one file per pipeline rank holding that rank's chunks as ``model``
(one chunk) or ``model0``, ``model1``, ... with layer numbers counted from the chunk's first
layer. Megatron loads ``model<i>`` into local chunk ``i`` by those local names and skips a key it
does not find, so the checkpoint is only right for a run whose every rank holds the same layers
in the same chunks. Under another placement it loads nothing (``model`` vs ``model0``/``model1``)
or loads layers into the wrong places, and still prints ``successfully loaded checkpoint``.

A :data:`LayoutTable` says, for every pipeline rank and each of its chunks, ``(first layer, layer
count, holds the embedding, holds the loss)``. Every rank computes the same whole table, so the
verdict of :func:`mismatch` is the same on every rank (no rank refuses while another goes on and
waits for it), and the saved table is what :mod:`.checkpoint_mapping` needs to move the weights onto
other chunks. ``torch_dist`` checkpoints need none of this: they key every tensor by its global
layer number.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ..runtime.layer_map import chunk_layouts
from ..schedules import registry
from ..schedules.ir import ScheduleError
from ..schedules.layer_split import LayerSplitError
from ..schedules.placement import make_placement
from .config import AUTO
from .features.layer_placement import layer_split_from_args
from .uneven import layout_is_ours

Chunk = tuple[int, int, bool, bool]  # (first layer, layer count, embedding, loss)
LayoutTable = tuple[tuple[Chunk, ...], ...]  # per pipeline rank, per local chunk

RECORD_KEY = "megatron_pp_ext_chunk_layouts"  # what a saving run adds to its torch-format state dict

# The flags that decide where megatron (with or without a plugin schedule) puts each layer.
PLACEMENT_ARGS = (
    "pipeline_schedule",
    "pipeline_schedule_file",
    "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size",
    "num_layers",
    "num_layers_per_virtual_pipeline_stage",
    "pipeline_model_parallel_layout",
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
    "hybrid_layer_pattern",
)


def normalise(table: Sequence[Sequence[Sequence[Any]]]) -> LayoutTable:
    """A table as tuples of plain ints and bools (a checkpoint stores it as lists)."""
    return tuple(tuple((int(c[0]), int(c[1]), bool(c[2]), bool(c[3])) for c in chunks) for chunks in table)


def as_record(table: LayoutTable) -> list[list[list[int | bool]]]:
    """The table as nested lists of ints and bools: what torch's weights-only unpickler loads."""
    return [[list(chunk) for chunk in chunks] for chunks in table]


def table_of_layouts(per_rank: Sequence[Sequence[Any]]) -> LayoutTable:
    """A table from :class:`~megatron_pp_ext.runtime.layer_map.ChunkLayout` lists, one list per pipeline rank."""
    return tuple(
        tuple((c.layer_offset, c.num_layers, c.pre_process, c.post_process) for c in chunks) for chunks in per_rank
    )


def table_from_args(args: Any) -> LayoutTable | None:
    """The table megatron's ``args`` (those of a checkpoint, say) lead to; None when they do not say.

    Derived like the run builds its chunks: the schedule's placement style (megatron's own schedule:
    the loop placement), ``virtual_pipeline_model_parallel_size`` chunks per rank, megatron's uneven-split
    flags (a layout string too under a V / bidirectional placement). Not derivable: a schedule file, ``auto``
    (its choice is not in ``args``), megatron's explicit ``--pipeline-model-parallel-layout`` of its loop placement.
    """
    name = getattr(args, "pipeline_schedule", None)
    if getattr(args, "pipeline_schedule_file", None):
        return None
    if getattr(args, "pipeline_model_parallel_layout", None) and not (name and name != AUTO and layout_is_ours(args)):
        return None  # megatron's own layout of its loop placement
    p = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    chunks = int(getattr(args, "virtual_pipeline_model_parallel_size", None) or 1)
    num_layers = getattr(args, "num_layers", None)
    if name == AUTO or num_layers is None:
        return None
    try:
        style = registry.get(name).placement if name else "loop"
        placement = make_placement(style, p, chunks)
        split = layer_split_from_args(args)
        pattern = getattr(args, "hybrid_layer_pattern", None)
        if pattern:  # a HybridModel: stage s holds the pattern's segment s
            from ..runtime.hybrid_pattern import hybrid_layer_split

            split = hybrid_layer_split(pattern.split("/")[0], placement, name or "megatron's schedule")
        return table_of_layouts([chunk_layouts(placement, int(num_layers), r, split) for r in range(p)])
    except (ScheduleError, LayerSplitError, TypeError, ValueError):
        return None


def placement_args(args: Any) -> tuple[Any, ...]:
    """The values of :data:`PLACEMENT_ARGS` in ``args``."""
    return tuple(getattr(args, name, None) for name in PLACEMENT_ARGS)


def saved_table(state_dict: dict[str, Any]) -> LayoutTable | None:
    """The table a torch-format checkpoint was saved with: its record, else derived from its ``args``."""
    record = state_dict.get(RECORD_KEY)
    if record is not None:
        return normalise(record)
    saved_args = state_dict.get("args")
    return table_from_args(saved_args) if saved_args is not None else None


def mismatch(state_dict: dict[str, Any], current: LayoutTable, current_args: Any) -> str | None:
    """Why this torch-format checkpoint cannot load into a run whose chunks are ``current``; None when it can.

    Without a record and without derivable ``args`` (a checkpoint of an older version saved under a
    schedule file, ``auto`` or an explicit megatron layout), it loads only when every placement flag is
    the same as this run's and none of them is ``auto``.
    """
    saved = saved_table(state_dict)
    if saved is not None:
        return None if saved == current else f"{describe(saved)}; this run: {describe(current)}"
    saved_args = state_dict.get("args")
    if (
        saved_args is not None
        and getattr(saved_args, "pipeline_schedule", None) != AUTO
        and placement_args(saved_args) == placement_args(current_args)
    ):
        return None
    return f"placement not recorded and not derivable from its arguments; this run: {describe(current)}"


def describe(table: LayoutTable) -> str:
    """``rank 0 [emb 0-1 | 3 loss], rank 1 [...]``: every rank's chunks (``|`` between chunks)."""

    def chunk(first: int, count: int, embedding: bool, loss: bool) -> str:
        layers = f"{first}" if count == 1 else (f"{first}-{first + count - 1}" if count else "no layers")
        return " ".join([*(["emb"] if embedding else []), layers, *(["loss"] if loss else [])])

    return ", ".join(f"rank {r} [{' | '.join(chunk(*c) for c in chunks)}]" for r, chunks in enumerate(table))


def schedule_label(args: Any) -> str:
    """How ``args`` name their schedule, for messages."""
    if args is None:
        return "unknown schedule"
    name = getattr(args, "pipeline_schedule", None) or getattr(args, "pipeline_schedule_file", None)
    return str(name) if name else "megatron's own schedule"
