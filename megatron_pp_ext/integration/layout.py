"""Make megatron build (and treat) model chunks the way a schedule's placement says.

A placement maps each pipeline stage to ``(rank, chunk)``; :func:`megatron_pp_ext.runtime.layer_map.chunk_layouts`
gives, for every local chunk, its layers and whether it holds the embedding (``pre_process``)
and the loss (``post_process``). Megatron answers the same questions itself:

* which layers a chunk holds: ``get_transformer_layer_offset`` and ``get_num_layers_to_build``;
* whether a chunk holds the embedding / the loss: always as the pair
  ``is_vp_first_stage(vp_stage, vp_size) and is_pp_first_stage(pp_group)`` (and ``..._last_...``)
  — in ``get_model``, the ``GPTModelBuilder``, ``build_virtual_pipeline_stages``,
  ``LanguageModule`` (tied embeddings), ``Float16Module``, ``TransformerBlock`` — and through
  ``parallel_state.is_pipeline_first_stage / is_pipeline_last_stage(ignore_virtual, vp_stage)``;
* which rank prints the loss: ``megatron.training.utils.is_last_rank``.

For megatron's loop placement (``1f1b``, ``interleaved-1f1b``, ...) these already agree with
:func:`chunk_layouts` (tested). For any other placement :func:`activate` (called by
:func:`megatron_pp_ext.install`) replaces them so that they answer from the placement:

* ``is_vp_first_stage(c)`` / ``is_vp_last_stage(c)``: does chunk ``c`` *of this rank* hold a
  first / last stage; ``is_pp_first_stage(g)`` / ``is_pp_last_stage(g)``: does the rank hold a
  first / last stage in any chunk. Their conjunction, which is how megatron uses them, is then
  exactly "this chunk holds the embedding / the loss" for every placement;
* ``parallel_state.is_pipeline_first_stage / last_stage``: the same, per chunk when
  ``ignore_virtual=False``, per rank otherwise;
* layer offset and count of a chunk: from :func:`chunk_layouts`; a ``HybridModel`` chunk's layers
  (``select_pipeline_segment``): the pattern's segment of the chunk's model stage;
* ``is_last_rank``: the rank holding the last stage in the pipeline of the global last rank.

A user's own ``model_provider(pre_process, post_process, vp_stage, ...)`` gets the right
``pre_process`` / ``post_process`` and megatron's ``TransformerBlock`` the right layers without
doing anything. Code that computes layer placement itself must ask
:func:`chunk_layouts_for_this_rank` (exported as ``megatron_pp_ext.chunk_layouts_for_this_rank``);
a training script passes :func:`get_embedding_ranks` / :func:`get_position_embedding_ranks` to
``pretrain()`` and picks data per chunk with :func:`chunk_is_first_last`.

Tied embeddings: megatron keeps a copy of the word embeddings in the output layer, zeroed at
construction and all-reduced with the embedding across the embedding group. When one rank holds
both (V-shape), :func:`tie_local_embeddings` (hooked into megatron's model builders) copies them
locally. Not handled here: summing the gradients of those two local copies every iteration (runtime,
``embedding_sync.py``); the two model copies of a bidirectional placement (``replicas.py``) and their
losses living on two ranks (``losses.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from typing import Any

from ..runtime.layer_map import ChunkLayout, chunk_layouts
from ..runtime.mtp import holds_mtp_without_embedding
from ..schedules.layer_split import LayerSplit, stage_layer_counts
from ..schedules.placement import Placement
from ._patching import Patcher

_PATCHER = Patcher()
_ACTIVE: tuple[Placement, int, LayerSplit | None] | None = None


def active() -> tuple[Placement, int, LayerSplit | None] | None:
    """``(placement, num_layers, layer split)`` when the hooks are active, else None."""
    return _ACTIVE


@lru_cache(maxsize=256)
def _layouts(
    placement: Placement, num_layers: int, rank: int, split: LayerSplit | None = None
) -> tuple[ChunkLayout, ...]:
    return tuple(chunk_layouts(placement, num_layers, rank, split))


def _this_pp_rank() -> int:
    from megatron.core import parallel_state

    return int(parallel_state.get_pipeline_model_parallel_rank())


def _group_rank(group: Any) -> int:
    return _this_pp_rank() if group is None else int(group.rank())


def _chunk(rank: int, vp_stage: int | None) -> ChunkLayout:
    assert _ACTIVE is not None
    layouts = _layouts(_ACTIVE[0], _ACTIVE[1], rank, _ACTIVE[2])
    chunk = 0 if vp_stage is None else int(vp_stage)
    if not 0 <= chunk < len(layouts):
        raise IndexError(f"rank {rank} holds {len(layouts)} chunk(s); asked for chunk {chunk}")
    return layouts[chunk]


def _rank_holds(rank: int, what: str) -> bool:
    assert _ACTIVE is not None
    return any(getattr(c, what) for c in _layouts(_ACTIVE[0], _ACTIVE[1], rank, _ACTIVE[2]))


# ---- the replacements -------------------------------------------------------------------------------
def is_vp_first_stage(vp_stage: int | None, vp_size: int | None = None) -> bool:
    return _chunk(_this_pp_rank(), vp_stage).pre_process


def is_vp_last_stage(vp_stage: int | None, vp_size: int | None = None) -> bool:
    return _chunk(_this_pp_rank(), vp_stage).post_process


def is_pp_first_stage(pp_group: Any) -> bool:
    return _rank_holds(_group_rank(pp_group), "pre_process")


def is_pp_last_stage(pp_group: Any) -> bool:
    return _rank_holds(_group_rank(pp_group), "post_process")


def _per_chunk(ignore_virtual: bool, vp_stage: int | None) -> bool:
    if ignore_virtual:
        return False
    from megatron.core import parallel_state

    if parallel_state.get_virtual_pipeline_model_parallel_world_size() is not None:
        assert vp_stage is not None, "vp_stage must be passed if virtual pipeline is enabled"
    return vp_stage is not None


def is_pipeline_first_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    rank = _this_pp_rank()
    if _per_chunk(ignore_virtual, vp_stage):
        return _chunk(rank, vp_stage).pre_process
    return _rank_holds(rank, "pre_process")


def is_pipeline_last_stage(ignore_virtual: bool = True, vp_stage: int | None = None) -> bool:
    rank = _this_pp_rank()
    if _per_chunk(ignore_virtual, vp_stage):
        return _chunk(rank, vp_stage).post_process
    return _rank_holds(rank, "post_process")


def get_transformer_layer_offset(config: Any, vp_stage: int | None = None, pp_rank: int | None = None) -> int:
    return _chunk(_this_pp_rank() if pp_rank is None else pp_rank, vp_stage).layer_offset


def get_num_layers_to_build(config: Any, vp_stage: int | None = None, pp_rank: int | None = None) -> int:
    return _chunk(_this_pp_rank() if pp_rank is None else pp_rank, vp_stage).num_layers


def select_pipeline_segment(
    main_pattern: str, pp_group: Any, vp_stage: int | None, *unused: Any, **unused_kw: Any
) -> tuple[list[str], int]:
    """``HybridModel``'s layers of a chunk: the pattern's layers of the chunk's model stage (its segment)."""
    from ..runtime.hybrid_pattern import chunk_layer_types

    layout = _chunk(_group_rank(pp_group), vp_stage)
    return chunk_layer_types(main_pattern, layout), layout.layer_offset


def loss_pp_rank(placement: Placement) -> int:
    """The pipeline rank whose losses megatron logs: the highest one holding a last stage."""
    return max(placement.rank_of(s) for s in range(placement.num_stages) if placement.is_last(s))


def is_last_rank() -> bool:
    import torch.distributed as dist
    from megatron.core import parallel_state

    assert _ACTIVE is not None
    world = dist.get_world_size()
    group_ranks = dist.get_process_group_ranks(parallel_state.get_pipeline_model_parallel_group())
    return (world - 1) in group_ranks and _this_pp_rank() == loss_pp_rank(_ACTIVE[0])


_HOOKS: tuple[tuple[str, str, Callable[..., Any]], ...] = (
    ("megatron.core.pipeline_parallel.utils", "is_vp_first_stage", is_vp_first_stage),
    ("megatron.core.pipeline_parallel.utils", "is_vp_last_stage", is_vp_last_stage),
    ("megatron.core.pipeline_parallel.utils", "is_pp_first_stage", is_pp_first_stage),
    ("megatron.core.pipeline_parallel.utils", "is_pp_last_stage", is_pp_last_stage),
    ("megatron.core.parallel_state", "is_pipeline_first_stage", is_pipeline_first_stage),
    ("megatron.core.parallel_state", "is_pipeline_last_stage", is_pipeline_last_stage),
    ("megatron.core.transformer.transformer_layer", "get_transformer_layer_offset", get_transformer_layer_offset),
    ("megatron.core.transformer.transformer_block", "get_num_layers_to_build", get_num_layers_to_build),
    # HybridModel imports it when it builds a chunk
    ("megatron.core.models.hybrid.hybrid_layer_allocation", "select_pipeline_segment", select_pipeline_segment),
)
_OPTIONAL_HOOKS: tuple[tuple[str, str, Callable[..., Any]], ...] = (
    ("megatron.training.utils.common_utils", "is_last_rank", is_last_rank),
)
# Modules that import the functions above by name (megatron-core 0.19.2); imported before
# patching so that their copies are replaced too.
_IMPORTERS = (
    "megatron.core.transformer.transformer_block",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.models.common.language_module.language_module",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.transformer.multi_token_prediction",
)
_OPTIONAL_IMPORTERS = (
    "megatron.training.training",
    "megatron.training.models.gpt",
    "megatron.training.models.hybrid",
    "megatron.training.utils",
)


def _unwrap(module: Any) -> Any:
    while not hasattr(module, "shared_embedding_or_output_weight") and hasattr(module, "module"):
        module = module.module
    return module


def tie_local_embeddings(model_chunks: Any) -> None:
    """Give a chunk's tied output layer (or its multi-token prediction layers' embedding copy) the embedding
    weights of the same replica's embedding chunk when both sit on this rank (V-shape: rank 0). Megatron
    initialises the copy to zero and all-reduces it with the embedding across the embedding group, which is
    this rank alone then."""
    if _ACTIVE is None:
        return
    import torch

    chunks = [_unwrap(c) for c in (model_chunks if isinstance(model_chunks, list) else [model_chunks])]
    layouts = _layouts(_ACTIVE[0], _ACTIVE[1], _this_pp_rank(), _ACTIVE[2])
    if len(chunks) != len(layouts):
        return
    for layout, chunk in zip(layouts, chunks, strict=True):
        if not (layout.post_process and not layout.pre_process):
            continue
        if not (getattr(chunk, "share_embeddings_and_output_weights", False) or holds_mtp_without_embedding(chunk)):
            continue
        source = next((chunks[o.chunk] for o in layouts if o.pre_process and o.replica == layout.replica), None)
        if source is not None:
            with torch.no_grad():
                chunk.shared_embedding_or_output_weight().copy_(source.shared_embedding_or_output_weight())


_BUILDERS = (
    ("megatron.training.models.dist_utils", "build_virtual_pipeline_stages"),  # config-container path
    ("megatron.training.training", "get_model"),  # model_provider path
)


def activate(placement: Placement, num_layers: int, split: LayerSplit | None = None) -> None:
    """Make megatron's layer placement and first/last-stage answers follow ``placement`` (idempotent)."""
    global _ACTIVE
    counts = stage_layer_counts(num_layers, placement.stages_per_replica, split)  # raises LayerSplitError
    _ACTIVE = (placement, num_layers, split)
    if not _PATCHER.active:
        _install_hooks()
    if split is not None and not split.even and placement.style != "loop":
        from .uneven import patch_transformer_config

        patch_transformer_config(_PATCHER, counts)  # megatron's own checks of the flags assume its placement


def _install_hooks() -> None:
    import importlib

    for name in _IMPORTERS:
        importlib.import_module(name)
    for name in _OPTIONAL_IMPORTERS:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    for module, attr, func in _HOOKS:
        _PATCHER.replace(module, attr, func)
    for module, attr, func in _OPTIONAL_HOOKS:
        try:
            _PATCHER.replace(module, attr, func)
        except ImportError:
            pass
    for module, attr in _BUILDERS:
        try:
            _PATCHER.call_after(module, attr, tie_local_embeddings)  # ties what megatron built
        except ImportError:
            pass
    _tie_mtp_embedding_locally()


def _tie_mtp_embedding_locally() -> None:
    """A chunk holding MTP layers joins megatron's construction-time embedding all-reduce as the same chunk
    without them would, where the placement puts each model copy's two ends on one rank (V, bidirectional).

    Megatron's ``LanguageModule._is_in_embd_group`` makes every MTP chunk all-reduce its embedding copy over the
    embedding group; under a bidirectional placement both ranks of that group hold an MTP chunk and an embedding
    stage, and the counts of all-reduces per rank differ (a hang at model construction). There the copy comes
    from the local embedding stage instead (:func:`tie_local_embeddings`), as the tied output layer's does."""
    from megatron.core.models.common.language_module.language_module import LanguageModule

    from ..runtime.embedding_sync import ends_on_same_rank

    original = LanguageModule._is_in_embd_group

    def is_in_embd_group(self: Any) -> bool:
        if getattr(self, "mtp_process", False) and _ACTIVE is not None and ends_on_same_rank(_ACTIVE[0]):
            self.mtp_process = False  # megatron's answer for this chunk without its MTP layers
            try:
                return bool(original(self))
            finally:
                self.mtp_process = True
        return bool(original(self))

    LanguageModule._is_in_embd_group = is_in_embd_group  # type: ignore[method-assign]
    _PATCHER.on_restore(lambda: setattr(LanguageModule, "_is_in_embd_group", original))


def deactivate() -> None:
    """Give megatron its own functions back."""
    global _ACTIVE
    _PATCHER.restore()
    _ACTIVE = None


# ---- helpers for training scripts ------------------------------------------------------------------
def chunk_is_first_last(vp_stage: int | None) -> tuple[bool, bool]:
    """Whether this rank's chunk ``vp_stage`` holds the embedding side / the loss side (needs data)."""
    from megatron.core import mpu

    per_chunk = vp_stage is not None
    return (
        bool(mpu.is_pipeline_first_stage(ignore_virtual=not per_chunk, vp_stage=vp_stage)),
        bool(mpu.is_pipeline_last_stage(ignore_virtual=not per_chunk, vp_stage=vp_stage)),
    )


@lru_cache(maxsize=8)
def _megatron_layout(text: str, pp: int) -> Any:
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    return PipelineParallelLayerLayout(text, pp)


def chunk_holds_mtp(args: Any, vp_stage: int | None) -> bool:
    """Whether this rank's chunk ``vp_stage`` builds megatron's multi-token prediction layers (it then needs
    every micro-batch's tokens, positions and labels, as the first and the last stage do).

    Megatron's own ``mtp_on_this_rank`` decides, asked with the layout megatron's model is built from: the
    parsed ``--pipeline-model-parallel-layout`` under megatron's loop placement, none under a V /
    bidirectional placement (the layout string is the plugin's there, and the MTP layers go with the loss:
    megatron then asks ``is_pipeline_last_stage``, which the hooks answer from the placement)."""
    if not getattr(args, "mtp_num_layers", None):
        return False
    from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank

    text = getattr(args, "pipeline_model_parallel_layout", None)
    ours = _ACTIVE is not None and _ACTIVE[0].style != "loop"
    megatron_layout = None if (text is None or ours) else _megatron_layout(text, args.pipeline_model_parallel_size)
    return bool(
        mtp_on_this_rank(
            layout=megatron_layout,
            mtp_num_layers=args.mtp_num_layers,
            ignore_virtual=vp_stage is None,
            vp_stage=vp_stage,
        )
    )


def _ranks_holding(placement: Placement, what: Callable[[int], bool]) -> list[int]:
    return sorted({placement.rank_of(s) for s in range(placement.num_stages) if what(s)})


def embedding_ranks_for(
    default: Callable[..., list[int]] | None = None,
) -> Callable[..., list[int]]:
    """A ``get_embedding_ranks`` for ``pretrain()``: ``default`` (megatron's when None) unless a
    non-loop placement is active, then the ranks holding a first or a last stage (V-shape: rank 0)."""

    def get_embedding_ranks(pp_ranks: list[int], *rest: Any) -> list[int]:
        if _ACTIVE is None or len(pp_ranks) == 1:
            if default is not None:
                return default(pp_ranks, *rest)
            return [pp_ranks[0]] if len(pp_ranks) == 1 else [pp_ranks[0], pp_ranks[-1]]
        placement = _ACTIVE[0]
        local = _ranks_holding(placement, lambda s: placement.is_first(s) or placement.is_last(s))
        return [pp_ranks[r] for r in local]

    return get_embedding_ranks


get_embedding_ranks = embedding_ranks_for()
get_embedding_ranks.__doc__ = "Megatron's default embedding ranks, or the active placement's (see embedding_ranks_for)."


def get_position_embedding_ranks(pp_ranks: list[int], *unused: Any) -> list[int]:
    """Ranks of a pipeline group that hold position embeddings: those with a first stage."""
    if _ACTIVE is None or len(pp_ranks) == 1:
        return [pp_ranks[0]]
    placement = _ACTIVE[0]
    return [pp_ranks[r] for r in _ranks_holding(placement, placement.is_first)]


def megatron_chunk_layouts(config: Any, rank: int) -> list[ChunkLayout]:
    """What megatron itself (hooks or not) builds on pipeline rank ``rank`` for ``config`` (a TransformerConfig)."""
    from megatron.core.pipeline_parallel import utils as pp_utils
    from megatron.core.transformer import transformer_block, transformer_layer

    p = config.pipeline_model_parallel_size
    vp = config.virtual_pipeline_model_parallel_size
    result = []
    for chunk in range(vp or 1):
        vp_stage = chunk if vp else None
        stage = chunk * p + rank
        if _ACTIVE is not None:
            layout = _chunk(rank, chunk)
            pre, post = layout.pre_process, layout.post_process
        else:
            pre = pp_utils.is_vp_first_stage(vp_stage, vp) and rank == 0
            post = pp_utils.is_vp_last_stage(vp_stage, vp) and rank == p - 1
        result.append(
            ChunkLayout(
                chunk=chunk,
                stage=stage,
                model_slice=stage,
                replica=0,
                layer_offset=int(transformer_layer.get_transformer_layer_offset(config, vp_stage, rank)),
                num_layers=int(transformer_block.get_num_layers_to_build(config, vp_stage, rank)),
                pre_process=bool(pre),
                post_process=bool(post),
            )
        )
    return result


def chunk_layouts_for_this_rank(config: Any = None) -> list[ChunkLayout]:
    """Layers and roles of this rank's chunks (index = ``vp_stage``), under the active schedule.

    With a plugin schedule's non-loop placement active, from its placement; otherwise megatron's
    own answer for ``config`` (a ``TransformerConfig``, required then).
    """
    rank = _this_pp_rank()
    if _ACTIVE is not None:
        return list(_layouts(_ACTIVE[0], _ACTIVE[1], rank, _ACTIVE[2]))
    if config is None:
        raise ValueError("chunk_layouts_for_this_rank needs megatron's TransformerConfig when no placement is active")
    return megatron_chunk_layouts(config, rank)
