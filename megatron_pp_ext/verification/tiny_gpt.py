"""A tiny megatron-core GPTModel (or HybridModel) split by a schedule's placement (for ``verify`` and tests).

Every chunk is a real ``GPTModel`` (local layer spec), or with ``hybrid_pattern`` a real ``HybridModel``
(``integration/hybrid.py``), holding the layers
:func:`~megatron_pp_ext.runtime.layer_map.chunk_layouts` assigns to it. All
chunks share one ``TransformerConfig``; a chunk's weights are copied from a
full-depth model built with the same seed, mapped by *global* layer number, so
a partitioned model starts from exactly the weights of the unpartitioned
reference whatever the placement.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..runtime.layer_map import ChunkLayout, chunk_layouts
from ..schedules.layer_split import LayerSplit
from ..schedules.placement import Placement

_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"\.experts\.local_experts\.(\d+)\.")


@dataclass(frozen=True)
class TinyGPTSpec:
    num_layers: int = 8
    hidden_size: int = 64
    num_attention_heads: int = 4
    seq_length: int = 16
    vocab_size: int = 128
    micro_batch_size: int = 2
    tied_embeddings: bool = True
    seed: int = 1234
    split: LayerSplit | None = None  # uneven stages (megatron's first/last-stage options)
    transformer_impl: str = "local"  # "transformer_engine": megatron's TE layer spec (CUDA; tests/gpu)
    recompute: str | None = None  # megatron's activation recomputation: "full" (uniform, 1 layer) or "selective"
    # MoE: every layer's MLP is megatron's MoE layer with this many experts (SequentialMLP), routed top-k,
    # with the load-balancing loss at this coefficient and this token dispatcher ("alltoall", "allgather").
    num_experts: int | None = None
    moe_topk: int = 2
    moe_aux_loss_coeff: float = 1e-2
    moe_dispatcher: str = "alltoall"
    # With the TE layer spec: the experts are megatron's TEGroupedMLP over TE's GroupedLinear (what
    # --moe-grouped-gemm builds) instead of SequentialMLP. CUDA only (tests/gpu).
    moe_grouped_gemm: bool = False
    # A HybridModel of this layer pattern ("*" attention, "-" MLP, "E" MoE; "|" between stages) instead
    # of a GPTModel; num_layers then follows the pattern. Segment s goes to model stage s (hybrid_pattern.py).
    # With "E" layers and no num_experts, 4 experts.
    hybrid_pattern: str | None = None
    # Multi-token prediction: this many megatron MTP layers (local spec) with the loss, on the chunk holding the
    # model's last stage; the model then uses rotary position embeddings (megatron's MTP needs rope or none).
    mtp_num_layers: int | None = None

    def __post_init__(self) -> None:
        if self.mtp_num_layers is not None and (self.mtp_num_layers < 1 or self.hybrid_pattern is not None):
            raise ValueError("mtp_num_layers must be >= 1, with a GPTModel (no hybrid_pattern)")
        if self.moe_grouped_gemm and (self.transformer_impl != "transformer_engine" or not self.num_experts):
            raise ValueError("moe_grouped_gemm needs num_experts and transformer_impl='transformer_engine'")
        if self.hybrid_pattern is not None:
            from ..runtime.hybrid_pattern import num_pattern_layers

            object.__setattr__(self, "num_layers", num_pattern_layers(self.hybrid_pattern))
            if "E" in self.hybrid_pattern and self.num_experts is None:
                object.__setattr__(self, "num_experts", 4)


def layer_split(spec: TinyGPTSpec, placement: Placement) -> LayerSplit | None:
    """The layers of each model stage: ``spec.split``, or the hybrid pattern's segments. A placement with
    fewer stages than segments (the references' one stage) takes consecutive segments together: the
    model is the same, only its cut differs."""
    if spec.hybrid_pattern is None:
        return spec.split
    from ..runtime.hybrid_pattern import hybrid_layer_split, pattern_segments

    segments = pattern_segments(spec.hybrid_pattern)
    stages = placement.stages_per_replica
    if len(segments) > stages and len(segments) % stages == 0:
        k = len(segments) // stages
        return LayerSplit(counts=tuple(len("".join(segments[i * k : (i + 1) * k])) for i in range(stages)))
    return hybrid_layer_split(spec.hybrid_pattern, placement, f"a {placement.style} placement")


RECOMPUTE = ("full", "selective")


def recompute_options(recompute: str | None) -> dict[str, Any]:
    """``TransformerConfig`` fields of megatron's ``--recompute-granularity``: ``full`` recomputes each layer
    (``--recompute-method uniform --recompute-num-layers 1``), ``selective`` the core attention."""
    if recompute is None:
        return {}
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, not {recompute!r}")
    if recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    return {"recompute_granularity": "selective"}


def make_config(spec: TinyGPTSpec, tp: int = 1, sequence_parallel: bool = False, ep: int = 1) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    moe: dict[str, Any] = {}
    if spec.num_experts:
        moe = {
            "num_moe_experts": spec.num_experts,
            "moe_router_topk": spec.moe_topk,
            "moe_aux_loss_coeff": spec.moe_aux_loss_coeff,
            "moe_token_dispatcher_type": spec.moe_dispatcher,
            "expert_model_parallel_size": ep,
            "add_bias_linear": False,
            "moe_grouped_gemm": spec.moe_grouped_gemm,
        }
    return TransformerConfig(
        **moe,
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        num_attention_heads=spec.num_attention_heads,
        use_cpu_initialization=True,
        pipeline_dtype=torch.float32,
        params_dtype=torch.float32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel,
        gradient_accumulation_fusion=False,
        deallocate_pipeline_outputs=True,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        mtp_num_layers=spec.mtp_num_layers,
        **recompute_options(spec.recompute),
    )


def _model(config: Any, spec: TinyGPTSpec, layout: ChunkLayout | None, vp_stage: int | None) -> Any:
    """A chunk holding ``layout``'s layers (the whole model when None)."""
    pre, post = (True, True) if layout is None else (layout.pre_process, layout.post_process)
    num_layers = spec.num_layers if layout is None else layout.num_layers
    if spec.hybrid_pattern is None:
        offset = 0 if layout is None else layout.layer_offset
        return _gpt(config, spec, num_layers, pre, post, vp_stage, offset)
    from ..integration.hybrid import build_hybrid_model
    from ..runtime.hybrid_pattern import chunk_layer_types

    offset = 0 if layout is None else layout.layer_offset
    types = (
        list(spec.hybrid_pattern.replace("|", "")) if layout is None else chunk_layer_types(spec.hybrid_pattern, layout)
    )
    return build_hybrid_model(
        config,
        types,
        offset,
        vocab_size=spec.vocab_size,
        max_sequence_length=spec.seq_length,
        pre_process=pre,
        post_process=post,
        share_embeddings_and_output_weights=spec.tied_embeddings,
        vp_stage=vp_stage,
        num_experts=spec.num_experts if "E" in types else None,
    )


def _mtp_block_spec(layer_spec: Any, num_layers: int) -> Any:
    """Megatron's MTP block of ``num_layers`` local-spec layers, each around a copy of ``layer_spec``."""
    from megatron.core.models.backends import LocalSpecProvider
    from megatron.core.transformer.multi_token_prediction import (
        MultiTokenPredictionBlockSubmodules,
        get_mtp_layer_spec_for_backend,
    )

    layer = get_mtp_layer_spec_for_backend(mtp_model_layer_spec=layer_spec, backend=LocalSpecProvider())
    return MultiTokenPredictionBlockSubmodules(layer_specs=[layer] * num_layers)


@contextlib.contextmanager
def _mtp_here(mtp: bool, layer_offset: int) -> Iterator[None]:
    """While a chunk of an MTP model is built, megatron's ``mtp_on_this_rank`` says ``mtp`` and its layers are
    numbered from ``layer_offset``: the chunks here are placed by their layout (the MTP layers with the loss), not
    by megatron's process-group view of the pipeline, and with MTP megatron puts the decoder's final norm on the
    chunk whose layer numbers reach ``num_layers``."""
    import megatron.core.models.gpt.gpt_model as gpt_model
    import megatron.core.transformer.multi_token_prediction as multi_token_prediction
    import megatron.core.transformer.transformer_layer as transformer_layer

    originals = (
        gpt_model.mtp_on_this_rank,
        multi_token_prediction.is_vp_last_stage,
        transformer_layer.get_transformer_layer_offset,
    )
    gpt_model.mtp_on_this_rank = lambda *args, **kwargs: mtp
    multi_token_prediction.is_vp_last_stage = lambda *args, **kwargs: mtp  # its rule: MTP with the last stage
    transformer_layer.get_transformer_layer_offset = lambda *args, **kwargs: layer_offset
    try:
        yield
    finally:
        (
            gpt_model.mtp_on_this_rank,
            multi_token_prediction.is_vp_last_stage,
            transformer_layer.get_transformer_layer_offset,
        ) = originals


def _gpt(
    config: Any, spec: TinyGPTSpec, num_layers: int, pre: bool, post: bool, vp_stage: int | None, offset: int = 0
) -> Any:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules

    if spec.transformer_impl == "transformer_engine":
        from megatron.core.extensions.transformer_engine import TENorm
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        layer_spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=spec.num_experts, moe_grouped_gemm=spec.moe_grouped_gemm
        )
        norm = TENorm
    else:
        layer_spec, norm = get_gpt_layer_local_spec(num_experts=spec.num_experts), LayerNormImpl
    block = TransformerBlockSubmodules(layer_specs=[layer_spec] * num_layers, layer_norm=norm)
    mtp = bool(spec.mtp_num_layers) and post  # the MTP layers go with the loss
    context = _mtp_here(mtp, offset) if spec.mtp_num_layers else contextlib.nullcontext()
    with context:
        return GPTModel(
            config=config,
            transformer_layer_spec=block,
            vocab_size=spec.vocab_size,
            max_sequence_length=spec.seq_length,
            pre_process=pre,
            post_process=post,
            share_embeddings_and_output_weights=spec.tied_embeddings,
            vp_stage=vp_stage,
            mtp_block_spec=_mtp_block_spec(layer_spec, spec.mtp_num_layers) if mtp and spec.mtp_num_layers else None,
            position_embedding_type="rope" if spec.mtp_num_layers else "learned_absolute",
        )


def build_full_model(config: Any, spec: TinyGPTSpec) -> Any:
    """The unpartitioned model (this rank's tensor-parallel shard), seeded."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(spec.seed)
    model_parallel_cuda_manual_seed(spec.seed)
    model = _model(config, spec, None, None)
    if spec.num_experts:
        _seed_by_name(model, spec, expert_offset(spec))
    return model


def expert_offset(spec: TinyGPTSpec) -> int:
    """Global index of this rank's first local expert (0 without experts or expert parallelism)."""
    from megatron.core import parallel_state as ps

    if not spec.num_experts or not ps.model_parallel_is_initialized():
        return 0
    return ps.get_expert_model_parallel_rank() * (spec.num_experts // ps.get_expert_model_parallel_world_size())


def _seed_by_name(model: Any, spec: TinyGPTSpec, offset: int) -> None:
    """MoE models: every matrix drawn from a generator seeded by its global name, so that an expert's
    weights (and every other layer's) do not depend on how many experts this rank holds (megatron's
    initialisation draws the local experts in turn from one stream). Vectors (norms, biases) keep
    megatron's constant initialisation."""
    import zlib

    std = model.config.init_method_std
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() < 2:
                continue
            key = f"{spec.seed}:{expert_global_name(name, offset)}"
            gen = torch.Generator().manual_seed(zlib.crc32(key.encode()))
            param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float64).mul_(std))


def expert_global_name(name: str, offset: int) -> str:
    """``name`` with its local expert index (``experts.local_experts.<i>``) made global (``+ offset``)."""
    match = _EXPERT_RE.search(name)
    if not match or not offset:
        return name
    return f"{name[: match.start(1)]}{int(match.group(1)) + offset}{name[match.end(1) :]}"


def global_name(name: str, layout: ChunkLayout, tied: bool, first_expert: int = 0) -> str:
    """Name of a chunk parameter in the unpartitioned model (``first_expert``: the global index of this
    rank's first local expert, with expert parallelism)."""
    name = expert_global_name(name, first_expert)
    match = _LAYER_RE.match(name)
    if match:
        return f"decoder.layers.{int(match.group(1)) + layout.layer_offset}.{name[match.end() :]}"
    if tied and name == "output_layer.weight":
        return "embedding.word_embeddings.weight"
    return name


def build_chunks(
    config: Any, spec: TinyGPTSpec, placement: Placement, rank: int
) -> tuple[list[Any], list[ChunkLayout]]:
    """This rank's chunks, with weights copied from the seeded full model."""
    offset = expert_offset(spec)
    full = {expert_global_name(name, offset): p for name, p in build_full_model(config, spec).named_parameters()}
    layouts = chunk_layouts(placement, spec.num_layers, rank, layer_split(spec, placement))
    chunks = []
    for layout in layouts:
        chunk = _model(config, spec, layout, layout.chunk)
        with torch.no_grad():
            for name, param in chunk.named_parameters():
                param.copy_(full[global_name(name, layout, spec.tied_embeddings, offset)])
        chunks.append(chunk)
    return chunks, layouts


def make_batches(spec: TinyGPTSpec, iteration: int, num_microbatches: int) -> list[dict[str, torch.Tensor]]:
    """Deterministic synthetic micro-batches of one iteration (same on every rank)."""
    gen = torch.Generator().manual_seed(spec.seed * 1000 + iteration)
    shape = (spec.micro_batch_size, spec.seq_length)
    batches = []
    for _ in range(num_microbatches):
        tokens = torch.randint(0, spec.vocab_size, shape, generator=gen)
        labels = torch.randint(0, spec.vocab_size, shape, generator=gen)
        batches.append(
            {
                "tokens": tokens,
                "labels": labels,
                "loss_mask": torch.ones(shape),
                "position_ids": torch.arange(spec.seq_length).unsqueeze(0).expand(shape).contiguous(),
            }
        )
    return batches


def _unwrap(model: Any) -> Any:
    while hasattr(model, "module"):
        model = model.module
    return model


def forward_step(data_iterator: Any, model: Any, return_schedule_plan: bool = False) -> tuple[Any, Any]:
    """megatron-style forward step: data only on chunks with the embedding, the MTP layers or the loss. With
    ``return_schedule_plan`` (megatron's combined step asks) the chunk's schedule plan instead of its output."""
    gpt = _unwrap(model)
    mtp = bool(getattr(gpt, "mtp_process", False))  # MTP layers embed the tokens themselves
    batch = next(data_iterator) if (gpt.pre_process or gpt.post_process or mtp) else None
    tokens = batch["tokens"] if gpt.pre_process or mtp else None
    positions = batch["position_ids"] if gpt.pre_process or mtp else None
    labels = batch["labels"] if gpt.post_process else None
    if return_schedule_plan:
        output = gpt.build_schedule_plan(tokens, positions, None, labels=labels)
    else:
        output = model(tokens, positions, None, labels=labels)
    loss_mask = batch["loss_mask"] if gpt.post_process else None

    def loss_func(output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        # fp32 and fp64 (the exact reference) keep their precision; half precision is summed in fp32
        dtype = output_tensor.dtype if output_tensor.dtype in (torch.float32, torch.float64) else torch.float32
        losses = output_tensor.to(dtype).view(-1)
        mask = loss_mask.view(-1).to(dtype)
        loss = torch.sum(losses * mask) / mask.sum()
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


def run_forward_backward(
    func: Any, spec: TinyGPTSpec, chunks: list[Any], batches: list[Any], *, chunk_list: bool, forward_only: bool = False
) -> list[float]:
    """Call a megatron-style forward-backward function once on this rank's ``chunks`` with ``batches`` (one
    iterator over them per chunk); the losses this rank computed. ``chunk_list``: pass the chunks as a list
    even when there is one (our executor takes a list; megatron's non-interleaved schedules one module)."""
    out = func(
        forward_step_func=forward_step,  # looked up per call: a test may patch it (verification/breaks.py)
        data_iterator=[iter(batches) for _ in chunks] if len(chunks) > 1 else iter(batches),
        model=chunks if chunk_list or len(chunks) > 1 else chunks[0],
        num_microbatches=len(batches),
        seq_length=spec.seq_length,
        micro_batch_size=spec.micro_batch_size,
        decoder_seq_length=spec.seq_length,
        forward_only=forward_only,
    )
    return [float(d["lm loss"]) for d in out]


def widen_to_float64(chunks: list[Any], config: Any) -> list[Any]:
    """The exact reference's model (:mod:`.criterion`): the same weights, widened exactly to float64."""
    config.params_dtype = config.pipeline_dtype = torch.float64
    return [c.double() for c in chunks]


@contextlib.contextmanager
def float64_cross_entropy() -> Iterator[None]:
    """Megatron's vocab-parallel cross-entropy in the logits' own dtype (it casts them to fp32, which
    would put fp32 rounding into the exact reference). Restored on exit: rank-pool workers run other
    specs afterwards."""
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy

    original = VocabParallelCrossEntropy.__dict__["calculate_logits_max"]

    def logits_max_in_input_dtype(vocab_parallel_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return vocab_parallel_logits, torch.max(vocab_parallel_logits, dim=-1)[0]

    VocabParallelCrossEntropy.calculate_logits_max = staticmethod(logits_max_in_input_dtype)  # type: ignore[method-assign]
    try:
        yield
    finally:
        VocabParallelCrossEntropy.calculate_logits_max = original  # type: ignore[method-assign]
