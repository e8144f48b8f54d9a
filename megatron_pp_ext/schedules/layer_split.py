"""Megatron's uneven pipeline splits as layer counts per model stage, for any placement.

:class:`LayerSplit` holds what megatron's flags say (``--decoder-first/last-pipeline-num-layers``,
``--account-for-embedding/loss-in-pipeline-split``, ``--pipeline-model-parallel-layout``);
:func:`stage_layer_counts` turns it into the transformer layers of each model stage (the placement's
stages in model order), or refuses with a :class:`LayerSplitError` naming the flag and what would work.
The chunks megatron builds (:mod:`megatron_pp_ext.runtime.layer_map`), ``megatron-pp verify`` and the
simulator's per-stage costs (:mod:`.split_costs`) all read these counts. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .ir import ScheduleError
from .placement import Placement
from .values import parse_layer_layout

__all__ = [
    "LAYOUT_FLAG",
    "SPLIT_FLAGS",
    "LayerSplit",
    "LayerSplitError",
    "add_split_arguments",
    "check_mtp_layers",
    "mtp_layout_problem",
    "placement_layer_counts",
    "split_from_args",
    "stage_layer_counts",
]


class LayerSplitError(ScheduleError):
    """The model's layers cannot be split into the placement's stages."""


@dataclass(frozen=True)
class LayerSplit:
    """Megatron's uneven pipeline splits, for any placement (slices in model order).

    ``first`` / ``last``: transformer layers of the first / last model slice
    (``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers``);
    ``embedding`` / ``loss``: the embedding / the loss counts as one layer of the first / last
    slice (``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``).
    The remaining layers split evenly over the other slices.
    ``layout``: every slice's layer symbols (``--pipeline-model-parallel-layout``, parsed by
    :func:`~megatron_pp_ext.schedules.values.parse_layer_layout`): slice ``i`` holds the ``t`` of stage ``i``.
    ``counts``: the transformer layers of every slice, given outright (a hybrid layer pattern's ``|``
    segments, ``runtime/hybrid_pattern.py``); excludes the other fields.
    """

    first: int | None = None
    last: int | None = None
    embedding: bool = False
    loss: bool = False
    layout: tuple[str, ...] | None = None
    counts: tuple[int, ...] | None = None

    @classmethod
    def from_layout(cls, text: str) -> LayerSplit:
        """The split a ``--pipeline-model-parallel-layout`` string gives (raises ValueError on bad syntax)."""
        return cls(layout=parse_layer_layout(text))

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
    if split.layout is not None:
        return _layout_counts(num_layers, num_slices, split)
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
    given = {0: split.first, num_slices - 1: split.last}
    fixed: dict[int, int] = {i: n for i, n in given.items() if n is not None}
    if any(n < 0 for n in fixed.values()):
        raise LayerSplitError("--decoder-first/last-pipeline-num-layers must be >= 0")
    rest = num_layers - sum(fixed.values())
    free = num_slices - len(fixed)
    if rest < 0 or (free == 0 and rest != 0) or (free and rest % free):
        flags = " and ".join(
            f"--decoder-{'first' if i == 0 else 'last'}-pipeline-num-layers {n}" for i, n in fixed.items()
        )
        if not flags:
            hint = f" (choose a multiple of {num_slices})"
        elif free == 0:
            hint = f": the {num_slices} stages hold {sum(fixed.values())} layers (make the counts add up to it)"
        elif rest < 0:
            hint = f": they hold more layers than the model has (e.g. --num-layers {sum(fixed.values()) + free})"
        else:
            fits = num_layers + (-rest) % free
            hint = f": the other {free} stages need equal shares of the remaining {rest} (e.g. --num-layers {fits})"
        raise LayerSplitError(
            f"--num-layers {num_layers} does not split evenly into the placement's {num_slices} stages"
            + (f" with {flags}" if flags else "")
            + hint
        )
    per = rest // free if free else 0
    return [fixed.get(i, per) for i in range(num_slices)]


LAYOUT_FLAG = "--pipeline-model-parallel-layout"
# megatron's flags for an uneven split, as (attribute, flag): megatron's training parser defines them for
# ``pretrain()``; :func:`add_split_arguments` gives other commands (``megatron-pp verify``) the same ones
SPLIT_FLAGS = (
    ("decoder_first_pipeline_num_layers", "--decoder-first-pipeline-num-layers"),
    ("decoder_last_pipeline_num_layers", "--decoder-last-pipeline-num-layers"),
    ("account_for_embedding_in_pipeline_split", "--account-for-embedding-in-pipeline-split"),
    ("account_for_loss_in_pipeline_split", "--account-for-loss-in-pipeline-split"),
    ("pipeline_model_parallel_layout", LAYOUT_FLAG),
)


def add_split_arguments(parser: Any) -> None:
    """Megatron's uneven-split flags (same names, types and meaning as megatron's) on an argparse parser."""
    first, last, embedding, loss, layout = (flag for _, flag in SPLIT_FLAGS)
    parser.add_argument(first, type=int, default=None, help="transformer layers of the first model stage")
    parser.add_argument(last, type=int, default=None, help="transformer layers of the last model stage")
    parser.add_argument(embedding, action="store_true", help="the embedding counts as one layer of the first stage")
    parser.add_argument(loss, action="store_true", help="the loss counts as one layer of the last stage")
    parser.add_argument(layout, default=None, help="every model stage's layers, e.g. 'Et|tt|t|tL' (docs/uneven.md)")


def split_from_args(args: Any) -> LayerSplit:
    """The :class:`LayerSplit` megatron's uneven-split flags in ``args`` ask for (raises ValueError on a
    layout string that does not parse)."""
    layout = getattr(args, "pipeline_model_parallel_layout", None)
    return LayerSplit(
        first=getattr(args, "decoder_first_pipeline_num_layers", None),
        last=getattr(args, "decoder_last_pipeline_num_layers", None),
        embedding=bool(getattr(args, "account_for_embedding_in_pipeline_split", False)),
        loss=bool(getattr(args, "account_for_loss_in_pipeline_split", False)),
        layout=None if layout is None else parse_layer_layout(layout),
    )


def _layout_counts(num_layers: int, num_slices: int, split: LayerSplit) -> list[int]:
    """A layout string's stages map onto the model slices in order: slice ``i`` gets stage ``i``'s layers."""
    assert split.layout is not None
    stages = split.layout
    if split.first is not None or split.last is not None or split.embedding or split.loss:
        raise LayerSplitError(
            f"{LAYOUT_FLAG} gives every stage's layers: not with --decoder-first/last-pipeline-num-layers or "
            "--account-for-embedding/loss-in-pipeline-split (give one or the other)"
        )
    text = "|".join(stages)
    if len(stages) != num_slices:
        raise LayerSplitError(
            f"layout {text!r} has {len(stages)} stage(s); this schedule's placement has {num_slices} "
            f"model stages (write {num_slices} stages separated by |)"
        )
    mtp_problem = mtp_layout_problem(stages)
    if mtp_problem:
        raise LayerSplitError(f"layout {text!r}: {mtp_problem}")
    ends_ok = "".join(stages).count("E") == stages[0].count("E") == 1 and (
        "".join(stages).count("L") == stages[-1].count("L") == 1
    )
    if not ends_ok:
        raise LayerSplitError(f"layout {text!r}: needs E once, in the first stage, and L once, in the last")
    counts = [stage.count("t") for stage in stages]
    if sum(counts) != num_layers:
        raise LayerSplitError(
            f"layout {text!r} holds {sum(counts)} transformer layer(s) (t), --num-layers is {num_layers}"
        )
    return counts


def placement_layer_counts(num_layers: int, placement: Placement, split: LayerSplit | None = None) -> list[int]:
    """:func:`stage_layer_counts` over ``placement``'s model stages, refusing where the flags mean something
    else: megatron applies them per pipeline rank when it interleaves chunks (loop placement, v > 1). Counts given
    outright (a hybrid pattern's segments) are per model stage under every placement, as megatron's own
    interleaving assigns segment ``vp_stage * p + rank``."""
    per_rank = split is not None and not split.even and split.counts is None  # counts: given per model stage
    if per_rank and placement.style == "loop" and placement.chunks_per_rank > 1:
        raise LayerSplitError(
            f"with {placement.chunks_per_rank} interleaved chunks per rank megatron splits by pipeline rank, not by "
            "model stage: the per-stage mapping covers one-chunk loop, V and bidirectional placements"
        )
    return stage_layer_counts(num_layers, placement.stages_per_replica, split)


def mtp_layout_problem(stages: tuple[str, ...]) -> str | None:
    """What is wrong with the multi-token prediction layers (``m``) of a layout's stages, or None.

    Megatron's rules (``PipelineParallelLayerLayout.validate_layer_layout``): every ``m`` after every ``t``, all
    of them in one stage, never on the first stage. The plugin's schedules add one: the ``m`` sit in the stage
    holding the loss ``L`` (the model's last stage, which a V placement puts on rank 0): the executor passes one
    activation shape between stages, and megatron's stage of MTP layers before the loss sends a longer one."""
    holding = [i for i, stage in enumerate(stages) if "m" in stage]
    if not holding:
        return None
    flat = "".join(stages)
    if "t" in flat[flat.index("m") :]:
        return "megatron places multi-token prediction layers (m) after every transformer layer (t)"
    if len(holding) > 1:
        return "megatron needs all multi-token prediction layers (m) in one stage"
    if len(stages) > 1 and holding[0] == 0:
        return "megatron never puts multi-token prediction layers (m) on the first stage"
    if "L" not in stages[holding[0]]:
        return (
            "with --pipeline-schedule the multi-token prediction layers (m) sit in the stage with the loss (L): "
            "move them there"
        )
    return None


def check_mtp_layers(stages: tuple[str, ...], mtp_num_layers: int | None) -> None:
    """Refuse (:class:`LayerSplitError`) a layout whose ``m`` do not match ``--mtp-num-layers`` (megatron's rule:
    as many ``m`` as MTP layers, none without the flag) or break :func:`mtp_layout_problem`'s rules."""
    text = "|".join(stages)
    found, wanted = "".join(stages).count("m"), mtp_num_layers or 0
    if found != wanted:
        raise LayerSplitError(
            f"layout {text!r} holds {found} multi-token prediction layer(s) (m), --mtp-num-layers is {wanted}: "
            "megatron needs one m per MTP layer"
        )
    problem = mtp_layout_problem(stages)
    if problem:
        raise LayerSplitError(f"layout {text!r}: {problem}")
