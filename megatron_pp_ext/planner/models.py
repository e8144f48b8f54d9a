"""GPT model shapes for the planner, with presets for the models of the pipeline papers.

A :class:`ModelSpec` holds what the memory and cost models need (layers, hidden size, heads,
sequence length, vocabulary, ...) with Megatron's defaults for everything a paper does not
state (tied embeddings, learned absolute positions, LayerNorm, GeLU MLP of ``4h``, biases,
dropout 0.1). Every preset says where its numbers come from; a number that could not be
confirmed from the paper is listed in ``assumed``.

Presets (``megatron-pp plan --model NAME``; ``models_table()`` prints them):

* zero-bubble paper (Qi et al., ICLR 2024, Table 3): ``zb-1.5b``, ``zb-6.2b``, ``zb-14.6b``,
  ``zb-28.3b`` -- layers, heads, hidden, sequence 1024, GPUs and micro-batch size confirmed;
  vocabulary assumed (GPT-2's 50257, the Megatron GPT default).
* controllable-memory paper (Qi et al., NeurIPS 2024, Table 2): ``cm-9.6b``, ``cm-21b``,
  ``cm-38.5b``, ``cm-98.5b`` -- layers, heads, hidden and GPUs confirmed (from a transcription
  of the table); sequence 1024 is the paper's setting for the 98.5B grid search (Table 3) and
  assumed for the others; vocabulary assumed.
* breadth-first paper (Lamy-Poirier, MLSys 2023): ``bf-6.6b``, ``bf-52b`` -- only the
  parameter counts are confirmed; layers / hidden / heads are the standard GPT shapes that give
  those counts, sequence length and vocabulary are assumed.
* layer-layout presets (``megatron-pp plan --layer-split search``): ``llama3-8b``, ``llama3-70b`` (Llama 3
  paper and model cards: a 128256 vocabulary makes the output layer + loss worth 2.1 / 1.1 layers),
  ``deepseek-v2-lite`` (DeepSeek-V2 paper, Appendix B: MoE with a dense first layer; its multi-head latent
  attention is costed as plain attention), ``nemotron-h-8b`` (Nemotron-H paper and model card: Mamba-2,
  attention and MLP layers in megatron's hybrid pattern); cluster size and batch assumed.
* MoE presets (``megatron-pp plan --moe-report``, docs/moe.md): ``deepseek-v3`` (DeepSeek-V3 technical report:
  61 layers, the first 3 dense, 256 routed experts of 2048 + 1 shared, top-8, MTP depth 1; its multi-head latent
  attention costed as plain attention), ``qwen3-235b-a22b`` (Qwen3 technical report and model card: 94 layers,
  128 experts of 1536, top-8, 64 heads / 4 KV) and ``mixtral-8x22b`` (Mistral AI's model card and configuration:
  56 layers, 8 experts of 16384, top-2, 48 heads / 8 KV); training sequence, cluster and batch assumed where
  the publication does not state them.
* ``tiny``: the CPU smoke-test model of ``scripts/run_tiny_cpu.sh`` (for the local launcher).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace

__all__ = [
    "HYBRID_KINDS",
    "LAYER_KINDS",
    "PRESETS",
    "ModelSpec",
    "ParameterCounts",
    "get_model",
    "kind_parameters",
    "model_names",
    "models_table",
    "parameter_counts",
]

#: Decoder layer kinds: a GPT layer, a GPT layer with a MoE MLP, and the single-mixer layers of a hybrid model.
LAYER_KINDS = ("dense", "moe", "mamba", "attention", "mlp", "moe-mlp")
#: Megatron's hybrid-pattern characters and the kind each builds.
HYBRID_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe-mlp"}


@dataclass(frozen=True)
class ParameterCounts:
    """Parameters of one transformer layer and of the embedding / head pieces, per TP rank
    where Megatron shards them (``layer_sharded`` / ``word_embedding``) and replicated."""

    layer_sharded: float  # per TP rank
    layer_replicated: float  # norms (and, with TP, the row-parallel biases)
    word_embedding: float  # per TP rank (vocabulary padded for this TP size)
    position_embedding: float  # learned absolute positions, not sharded
    final_norm: float

    @property
    def layer(self) -> float:
        """Parameters of one layer held by one TP rank."""
        return self.layer_sharded + self.layer_replicated


def parameter_counts(model: ModelSpec, tensor_parallel: int = 1) -> ParameterCounts:
    t = int(tensor_parallel)
    h, q, kv, f = model.hidden_size, model.q_size, model.kv_size, model.ffn
    norm = 2 if model.normalization == "LayerNorm" else 1
    up = 2 * f if model.swiglu else f
    weights = h * (q + 2 * kv) + q * h + h * up + f * h
    col_bias = (q + 2 * kv) + up if model.add_bias_linear else 0  # column-parallel: sharded
    row_bias = 2 * h if model.add_bias_linear else 0  # row-parallel outputs: replicated
    return ParameterCounts(
        layer_sharded=(weights + col_bias) / t,
        layer_replicated=2 * norm * h + row_bias,
        word_embedding=model.padded_vocab_size(t) * h / t,
        position_embedding=model.max_positions * h if model.position_embedding_type == "learned_absolute" else 0,
        final_norm=norm * h,
    )


def kind_parameters(model: ModelSpec, kind: str, tensor_parallel: int = 1) -> float:
    """Parameters of one decoder layer of ``kind`` held by one TP rank (experts are sharded by TP, as
    megatron's default expert tensor parallelism does; no expert parallelism)."""
    t = int(tensor_parallel)
    h, q, kv, f = model.hidden_size, model.q_size, model.kv_size, model.ffn
    norm = (2 if model.normalization == "LayerNorm" else 1) * h
    bias = model.add_bias_linear

    def mlp(width: int) -> float:
        up = 2 * width if model.swiglu else width
        return (h * up + width * h + (up if bias else 0)) / t + (h if bias else 0)

    attention = (h * (q + 2 * kv) + q * h + ((q + 2 * kv) if bias else 0)) / t + (h if bias else 0) + norm
    experts = (model.num_experts or 0) * mlp(model.expert_ffn) + h * (model.num_experts or 0)  # + router
    shared = mlp(model.moe_shared_expert_ffn) if model.moe_shared_expert_ffn else 0.0
    if kind == "dense":
        return parameter_counts(model, t).layer
    if kind == "moe":
        return attention + norm + experts + shared
    if kind == "attention":
        return attention
    if kind == "mlp":
        return mlp(f) + norm
    if kind == "moe-mlp":
        return experts + shared + norm
    if kind == "mamba":
        di, groups, state = 2 * h, model.mamba_num_groups, model.mamba_state_dim
        heads = di // model.mamba_head_dim
        in_proj = h * (2 * di + 2 * groups * state + heads)
        conv = 4 * (di + 2 * groups * state)
        return (in_proj + di * h + conv + 3 * heads + di) / t + norm
    raise ValueError(f"unknown layer kind {kind!r}; kinds: {', '.join(LAYER_KINDS)}")


@dataclass(frozen=True)
class ModelSpec:
    """A dense GPT (decoder-only transformer) as Megatron builds it."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    seq_length: int
    vocab_size: int = 50257
    ffn_hidden_size: int | None = None  # default 4 * hidden_size
    kv_channels: int | None = None  # default hidden_size // num_attention_heads
    num_query_groups: int | None = None  # None = multi-head attention (no GQA)
    swiglu: bool = False
    untie_embeddings_and_output_weights: bool = False
    position_embedding_type: str = "learned_absolute"  # learned_absolute | rope | none
    max_position_embeddings: int | None = None  # default seq_length
    normalization: str = "LayerNorm"  # LayerNorm | RMSNorm
    add_bias_linear: bool = True
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    make_vocab_size_divisible_by: int = 128
    # Mixture of experts (megatron's --num-experts, --moe-ffn-hidden-size, --moe-router-topk,
    # --moe-shared-expert-intermediate-size, --moe-layer-freq with the first layers dense); no expert parallelism.
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None  # one expert's FFN width (default ffn)
    moe_router_topk: int = 2
    moe_shared_expert_ffn: int = 0  # total FFN width of the shared experts (0: none)
    moe_first_dense_layers: int = 0  # the first layers keep a dense MLP (DeepSeek's first_k_dense_replace)
    mtp_num_layers: int = 0  # megatron's --mtp-num-layers (recorded and passed on; not costed by the planner)
    # Hybrid models: one character per layer in megatron's hybrid alphabet (M Mamba-2 mixer,
    # * self-attention, - MLP, E MoE MLP); num_layers must equal its length. None: GPT layers.
    hybrid_pattern: str | None = None
    mamba_state_dim: int = 128
    mamba_head_dim: int = 64
    mamba_num_groups: int = 8
    # Paper settings (defaults for `plan`), provenance.
    default_gpus: int | None = None
    default_global_batch: int | None = None
    default_micro_batch: int | None = None
    source: str = ""
    assumed: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "vocab_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model {self.name}: {name} must be a positive integer, got {value!r}")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model {self.name}: hidden size {self.hidden_size} is not a multiple of "
                f"{self.num_attention_heads} heads; give kv_channels"
            )
        if self.num_query_groups is not None and self.num_attention_heads % self.num_query_groups:
            raise ValueError(f"model {self.name}: {self.num_attention_heads} heads not a multiple of query groups")
        if self.position_embedding_type not in ("learned_absolute", "rope", "none"):
            raise ValueError(f"model {self.name}: unknown position embedding type {self.position_embedding_type!r}")
        if self.normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"model {self.name}: unknown normalization {self.normalization!r}")
        if self.hybrid_pattern is not None:
            bad = sorted(set(self.hybrid_pattern) - set(HYBRID_KINDS))
            if bad or len(self.hybrid_pattern) != self.num_layers:
                raise ValueError(
                    f"model {self.name}: hybrid pattern must be {self.num_layers} characters of "
                    f"{''.join(HYBRID_KINDS)} (M Mamba, * attention, - MLP, E MoE), got {self.hybrid_pattern!r}"
                )
        if ("E" in (self.hybrid_pattern or "") or self.moe_first_dense_layers) and not self.num_experts:
            raise ValueError(f"model {self.name}: MoE layers need num_experts")
        if not 0 <= self.mtp_num_layers <= 8:
            raise ValueError(f"model {self.name}: mtp_num_layers must be in [0, 8]")
        if not 0 <= self.moe_first_dense_layers <= self.num_layers:
            raise ValueError(f"model {self.name}: moe_first_dense_layers must be in [0, {self.num_layers}]")

    # ---- derived shapes ---------------------------------------------------------------------
    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size if self.ffn_hidden_size is not None else 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.kv_channels if self.kv_channels is not None else self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        return self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads

    @property
    def q_size(self) -> int:
        """Width of the query projection (``heads * head_dim``)."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of each of the key and value projections."""
        return self.query_groups * self.head_dim

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings if self.max_position_embeddings is not None else self.seq_length

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.ffn

    def layer_kinds(self) -> tuple[str, ...]:
        """The kind of each decoder layer in model order (:data:`LAYER_KINDS`): ``dense`` (attention + MLP),
        ``moe`` (attention + MoE MLP), or a hybrid model's ``mamba`` / ``attention`` / ``mlp`` / ``moe-mlp``."""
        if self.hybrid_pattern is not None:
            return tuple(HYBRID_KINDS[c] for c in self.hybrid_pattern)
        if self.num_experts:
            k = self.moe_first_dense_layers
            return ("dense",) * k + ("moe",) * (self.num_layers - k)
        return ("dense",) * self.num_layers

    @property
    def uniform_layers(self) -> bool:
        """Every decoder layer is the same dense transformer layer."""
        return self.hybrid_pattern is None and not self.num_experts

    def padded_vocab_size(self, tensor_parallel: int) -> int:
        """Megatron pads the vocabulary to a multiple of ``make_vocab_size_divisible_by * TP``."""
        multiple = self.make_vocab_size_divisible_by * tensor_parallel
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def num_parameters(self, tensor_parallel: int = 1) -> int:
        """Total parameters (one copy of every weight; tied embeddings counted once)."""
        counts = parameter_counts(self, tensor_parallel)
        layers = (
            self.num_layers * counts.layer
            if self.uniform_layers
            else sum(kind_parameters(self, k, tensor_parallel) for k in self.layer_kinds())
        )
        total = layers + counts.word_embedding + counts.position_embedding + counts.final_norm
        if self.untie_embeddings_and_output_weights:
            total += counts.word_embedding
        return int(total)

    def megatron_args(self) -> list[str]:
        """The model flags of Megatron's ``pretrain_gpt.py`` describing this model."""
        args = [
            "--num-layers",
            str(self.num_layers),
            "--hidden-size",
            str(self.hidden_size),
            "--num-attention-heads",
            str(self.num_attention_heads),
            "--seq-length",
            str(self.seq_length),
            "--max-position-embeddings",
            str(self.max_positions),
            "--ffn-hidden-size",
            str(self.ffn),
        ]
        if self.kv_channels is not None:
            args += ["--kv-channels", str(self.kv_channels)]
        if self.num_query_groups is not None:
            args += ["--group-query-attention", "--num-query-groups", str(self.num_query_groups)]
        if self.swiglu:
            args.append("--swiglu")
        if self.untie_embeddings_and_output_weights:
            args.append("--untie-embeddings-and-output-weights")
        if self.position_embedding_type != "learned_absolute":
            args += ["--position-embedding-type", self.position_embedding_type]
        if self.normalization != "LayerNorm":
            args += ["--normalization", self.normalization]
        if not self.add_bias_linear:
            args.append("--disable-bias-linear")
        if self.num_experts:
            args += ["--num-experts", str(self.num_experts), "--moe-router-topk", str(self.moe_router_topk)]
            args += ["--moe-ffn-hidden-size", str(self.expert_ffn)]
            if self.moe_shared_expert_ffn:
                args += ["--moe-shared-expert-intermediate-size", str(self.moe_shared_expert_ffn)]
            if self.moe_first_dense_layers:
                k = self.moe_first_dense_layers
                args += ["--moe-layer-freq", f"([0]*{k}+[1]*{self.num_layers - k})"]
        if self.mtp_num_layers:
            args += ["--mtp-num-layers", str(self.mtp_num_layers)]
        args += ["--hidden-dropout", f"{self.hidden_dropout:g}", "--attention-dropout", f"{self.attention_dropout:g}"]
        return args

    def to_json_dict(self) -> dict[str, object]:
        """Every field, less the MoE / hybrid ones a dense GPT leaves at their defaults (a plan of a dense
        model reads as it did before those fields existed)."""
        out = asdict(self)
        for name in _LAYER_KIND_FIELDS:
            if out[name] == _DEFAULTS[name]:
                del out[name]
        return out

    def with_overrides(self, **changes: object) -> ModelSpec:
        """A copy with some fields replaced (``None`` values are ignored)."""
        given = {k: v for k, v in changes.items() if v is not None}
        if not given:
            return self
        return replace(self, **given)  # type: ignore[arg-type]


_LAYER_KIND_FIELDS = (
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_router_topk",
    "moe_shared_expert_ffn",
    "moe_first_dense_layers",
    "mtp_num_layers",
    "hybrid_pattern",
    "mamba_state_dim",
    "mamba_head_dim",
    "mamba_num_groups",
)
_DEFAULTS = {f.name: f.default for f in fields(ModelSpec)}

_ZB = "Qi et al., Zero Bubble Pipeline Parallelism, ICLR 2024, Table 3"
_CM = "Qi et al., Pipeline Parallelism with Controllable Memory, NeurIPS 2024, Table 2"
_BF = "Lamy-Poirier, Breadth-First Pipeline Parallelism, MLSys 2023"
_LLAMA3 = "Llama Team (Meta), The Llama 3 Herd of Models, 2024, Table 3, and the Meta-Llama-3 model cards"
_DSV2 = "DeepSeek-AI, DeepSeek-V2 (2024), Appendix B (DeepSeek-V2-Lite) and the DeepSeek-V2-Lite model card"
_DSV3 = "DeepSeek-AI, DeepSeek-V3 Technical Report (2024), Sections 3.1-3.4 and 4.2"
_QWEN3 = "Qwen Team, Qwen3 Technical Report (2025), Table 2, and the Qwen3-235B-A22B model card"
_MIXTRAL = "Mistral AI, Mixtral-8x22B-v0.1 model card and configuration (2024)"
_NEMOTRON_H = "NVIDIA, Nemotron-H: Hybrid Mamba-Transformer Models (2025) and the Nemotron-H-8B-Base-8K model card"
# Llama-style decoder: SwiGLU, RMSNorm, RoPE, no biases, no dropout, untied output layer
_MODERN = {
    "swiglu": True,
    "untie_embeddings_and_output_weights": True,
    "position_embedding_type": "rope",
    "normalization": "RMSNorm",
    "add_bias_linear": False,
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
}
_NEMOTRON_H_8B_PATTERN = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"

PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in (
        ModelSpec(
            "zb-1.5b",
            22,
            2304,
            24,
            1024,
            default_gpus=8,
            default_micro_batch=6,
            default_global_batch=6 * 32,
            source=_ZB + " (8 GPUs, micro-batch 6, 24/32/64 micro-batches)",
            assumed=("vocab_size",),
        ),
        ModelSpec(
            "zb-6.2b",
            30,
            4096,
            32,
            1024,
            default_gpus=8,
            default_micro_batch=3,
            default_global_batch=3 * 32,
            source=_ZB + " (8 GPUs, micro-batch 3, 24/32/64 micro-batches)",
            assumed=("vocab_size",),
        ),
        ModelSpec(
            "zb-14.6b",
            46,
            5120,
            40,
            1024,
            default_gpus=16,
            default_micro_batch=1,
            default_global_batch=64,
            source=_ZB + " (16 GPUs, micro-batch 1, 48/64/128 micro-batches)",
            assumed=("vocab_size",),
        ),
        ModelSpec(
            "zb-28.3b",
            62,
            6144,
            48,
            1024,
            default_gpus=32,
            default_micro_batch=1,
            default_global_batch=128,
            source=_ZB + " (32 GPUs, micro-batch 1, 96/128/256 micro-batches)",
            assumed=("vocab_size",),
        ),
        ModelSpec(
            "cm-9.6b",
            30,
            5120,
            40,
            1024,
            default_gpus=16,
            default_micro_batch=4,
            default_global_batch=4 * 64,
            source=_CM + " (16 GPUs; micro-batch 4 in Table 4)",
            assumed=("seq_length", "vocab_size", "default_global_batch"),
        ),
        ModelSpec(
            "cm-21b",
            46,
            6144,
            48,
            1024,
            default_gpus=24,
            default_micro_batch=2,
            default_global_batch=2 * 96,
            source=_CM + " (24 GPUs; micro-batch 2 in Table 4)",
            assumed=("seq_length", "vocab_size", "default_global_batch"),
        ),
        ModelSpec(
            "cm-38.5b",
            62,
            7168,
            64,
            1024,
            default_gpus=32,
            default_micro_batch=1,
            default_global_batch=128,
            source=_CM + " (32 GPUs; micro-batch 1 in Table 4)",
            assumed=("seq_length", "vocab_size", "default_global_batch"),
        ),
        ModelSpec(
            "cm-98.5b",
            78,
            10240,
            80,
            1024,
            default_gpus=40,
            default_global_batch=160,
            source=_CM + " (40 GPUs; Table 3: sequence 1024, batch 160, hybrid-parallel grid search)",
            assumed=("vocab_size",),
        ),
        ModelSpec(
            "bf-6.6b",
            32,
            4096,
            32,
            2048,
            default_gpus=64,
            default_global_batch=512,
            source=_BF + " (parameter count only; shape = standard GPT 6.7B-class)",
            assumed=(
                "num_layers",
                "hidden_size",
                "num_attention_heads",
                "seq_length",
                "vocab_size",
                "default_gpus",
                "default_global_batch",
            ),
        ),
        ModelSpec(
            "bf-52b",
            64,
            8192,
            64,
            1024,
            default_gpus=64,
            default_global_batch=256,
            source=_BF + " (parameter count only; shape = 64 x 8192 GPT, 51.9B parameters)",
            assumed=(
                "num_layers",
                "hidden_size",
                "num_attention_heads",
                "seq_length",
                "vocab_size",
                "default_gpus",
                "default_global_batch",
            ),
        ),
        ModelSpec(
            "llama3-8b",
            32,
            4096,
            32,
            8192,
            vocab_size=128256,
            ffn_hidden_size=14336,
            num_query_groups=8,
            **_MODERN,  # type: ignore[arg-type]
            default_gpus=8,
            default_micro_batch=1,
            default_global_batch=128,
            source=_LLAMA3 + " (32 layers, 4096 hidden, 32 heads / 8 KV, FFN 14336, vocabulary 128256, 8K context)",
            assumed=("default_gpus", "default_global_batch"),
        ),
        ModelSpec(
            "llama3-70b",
            80,
            8192,
            64,
            8192,
            vocab_size=128256,
            ffn_hidden_size=28672,
            num_query_groups=8,
            **_MODERN,  # type: ignore[arg-type]
            default_gpus=64,
            default_micro_batch=1,
            default_global_batch=512,
            source=_LLAMA3 + " (80 layers, 8192 hidden, 64 heads / 8 KV, FFN 28672, vocabulary 128256, 8K context)",
            assumed=("default_gpus", "default_global_batch"),
        ),
        ModelSpec(
            "deepseek-v2-lite",
            27,
            2048,
            16,
            4096,
            vocab_size=102400,
            ffn_hidden_size=10944,
            kv_channels=128,
            **_MODERN,  # type: ignore[arg-type]
            num_experts=64,
            moe_ffn_hidden_size=1408,
            moe_router_topk=6,
            moe_shared_expert_ffn=2 * 1408,
            moe_first_dense_layers=1,
            default_gpus=16,
            default_micro_batch=1,
            default_global_batch=256,
            source=_DSV2 + " (27 layers, 2048 hidden, 16 heads, 64 routed experts of 1408 / 6 active + 2 shared, "
            "first layer dense with FFN 10944, vocabulary 102400, 4K context)",
            assumed=(
                "attention (MLA costed as 16-head attention of head size 128)",
                "default_gpus",
                "default_global_batch",
            ),
        ),
        ModelSpec(
            "nemotron-h-8b",
            52,
            4096,
            32,
            8192,
            vocab_size=131072,
            ffn_hidden_size=21504,
            kv_channels=128,
            num_query_groups=8,
            **{**_MODERN, "swiglu": False},  # type: ignore[arg-type]
            hybrid_pattern=_NEMOTRON_H_8B_PATTERN,
            mamba_state_dim=128,
            mamba_head_dim=64,
            mamba_num_groups=8,
            default_gpus=8,
            default_micro_batch=1,
            default_global_batch=128,
            source=_NEMOTRON_H + " (52 layers: 24 Mamba-2, 4 attention, 24 MLP of 21504 (squared ReLU), 4096 hidden, "
            "32 heads / 8 KV, 128 Mamba heads of 64, state 128, 8K context)",
            assumed=("vocab_size", "mamba_num_groups", "default_gpus", "default_global_batch"),
        ),
        ModelSpec(
            "deepseek-v3",
            61,
            7168,
            128,
            4096,
            vocab_size=129280,
            ffn_hidden_size=18432,
            kv_channels=128,
            **_MODERN,  # type: ignore[arg-type]
            num_experts=256,
            moe_ffn_hidden_size=2048,
            moe_router_topk=8,
            moe_shared_expert_ffn=2048,
            moe_first_dense_layers=3,
            mtp_num_layers=1,
            default_gpus=2048,
            default_micro_batch=1,
            default_global_batch=15360,
            source=_DSV3 + " (61 layers, 7168 hidden, 128 heads, first 3 layers dense with FFN 18432, 256 routed "
            "experts of 2048 / 8 active + 1 shared, MTP depth 1, vocabulary 129K, 4K sequence; 2048 H800 GPUs, PP 16, "
            "EP 64; batch 15360 after its ramp-up)",
            assumed=("attention (MLA costed as 128-head attention of head size 128)", "default_micro_batch"),
        ),
        ModelSpec(
            "qwen3-235b-a22b",
            94,
            4096,
            64,
            4096,
            vocab_size=151936,
            ffn_hidden_size=12288,
            kv_channels=128,
            num_query_groups=4,
            **_MODERN,  # type: ignore[arg-type]
            num_experts=128,
            moe_ffn_hidden_size=1536,
            moe_router_topk=8,
            default_gpus=1024,
            default_micro_batch=1,
            default_global_batch=4096,
            source=_QWEN3 + " (94 layers, 4096 hidden, 64 heads / 4 KV of 128, 128 experts of 1536 / 8 active, "
            "no shared expert, vocabulary 151936, 4K pre-training sequence)",
            assumed=("default_gpus", "default_global_batch"),
        ),
        ModelSpec(
            "mixtral-8x22b",
            56,
            6144,
            48,
            4096,
            vocab_size=32768,
            ffn_hidden_size=16384,
            num_query_groups=8,
            **_MODERN,  # type: ignore[arg-type]
            num_experts=8,
            moe_router_topk=2,
            default_gpus=256,
            default_micro_batch=1,
            default_global_batch=1024,
            source=_MIXTRAL + " (56 layers, 6144 hidden, 48 heads / 8 KV, 8 experts of 16384 / 2 active, "
            "vocabulary 32768)",
            assumed=("seq_length (64K context; 4K training sequence assumed)", "default_gpus", "default_global_batch"),
        ),
        ModelSpec(
            "tiny",
            4,
            64,
            4,
            64,
            vocab_size=256,
            default_gpus=2,
            default_micro_batch=2,
            default_global_batch=8,
            source="CPU smoke test (scripts/run_tiny_cpu.sh shapes, NullTokenizer vocabulary 256)",
        ),
    )
}


def model_names() -> list[str]:
    return list(PRESETS)


def get_model(name: str) -> ModelSpec:
    key = str(name).strip().lower()
    if key not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[key]


def models_table() -> list[dict[str, object]]:
    """One row per preset (for ``megatron-pp plan --list-models`` and the docs)."""
    rows = []
    for spec in PRESETS.values():
        rows.append(
            {
                "name": spec.name,
                "params_B": round(spec.num_parameters() / 1e9, 2),
                "layers": spec.num_layers,
                "hidden": spec.hidden_size,
                "heads": spec.num_attention_heads,
                "seq": spec.seq_length,
                "vocab": spec.vocab_size,
                "gpus": spec.default_gpus,
                "global_batch": spec.default_global_batch,
                "assumed": ",".join(spec.assumed) or "-",
                "source": spec.source,
            }
        )
    return rows
