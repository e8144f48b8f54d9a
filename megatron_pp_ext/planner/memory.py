"""Per-rank memory model: weights, gradients, optimizer state, activations.

Static memory (per rank; ``P`` = parameters the rank holds, ``d`` = data-parallel size), as
Megatron (0.19.2) configures mixed precision with Adam:

================  ==========================================  ==========  ====================
precision         what is kept                                plain       distributed optimizer
================  ==========================================  ==========  ====================
``bf16``          bf16 params, fp32 grads (Megatron forces    18 P        (6 + 12/d) P
                  grad accumulation in fp32 for bf16), fp32
                  main params, fp32 Adam m and v
``fp16``          fp16 params and grads, fp32 main params,    20 P        (4 + 16/d) P
                  fp32 main grads, fp32 Adam m and v
``fp32``          fp32 params and grads, fp32 Adam m and v    16 P        (8 + 8/d) P
================  ==========================================  ==========  ====================

(the same table as Megatron-LM's distributed-optimizer documentation; the bf16 row is the one
``megatron.training.theoretical_memory_usage`` hard-codes).

Activations (bytes one layer keeps for one micro-batch until its backward), after Korthikanti
et al., "Reducing Activation Recomputation in Large Transformer Models" (Table 2), written per
tensor so that GQA, SwiGLU, ``ffn != 4h``, fp32 activations and no-dropout models come out
right (``a`` bytes per activation element, ``t`` TP size, ``sp`` = 1/t with sequence
parallelism else 1):

* outside the TP region, ``sp * s*b*h * (4a + 2)``: the inputs of the two norms, of the QKV
  and first MLP linear (``4a``) and the two dropout masks (1 byte each, absent when
  ``hidden_dropout == 0``);
* inside (divided by ``t``): Q, K, V and the output projection input ``a*s*b*(2q + 2kv)``, the
  MLP's first linear output and activation output ``a*s*b*f*(2 + 1 if SwiGLU)``;
* core attention, divided by ``t``: ``b*heads*s^2 * (2a + 1)`` (softmax output, dropout mask
  and output; ``a`` alone without attention dropout) with the unfused implementation, nothing
  (only a ``4*b*heads*s`` softmax statistic) with flash attention or selective recompute
  (which recomputes exactly this part);
* full recompute keeps only each layer's input, ``sp * a*s*b*h``, and re-materialises one
  layer's activations during its backward (counted once per rank as a transient).

For bf16, ``f = 4h``, no GQA, dropout on and unfused attention this is the paper's
``sbh(10 + 24/t + 5as/(ht))`` (``34 sbh/t`` with sequence parallelism and selective recompute).

The first stage also keeps the token ids (8 bytes each) and the embedding dropout mask; the
last stage keeps the final norm input and output and the fp32 softmax of the cross entropy
(``4*s*b*V/t`` bytes).

What a pending ``W`` keeps (zero-bubble paper, Table 1: ``M_W = 32 sbh`` per layer in 2-byte
elements against ``M_B = sb(34h + 5as)``): each deferred linear's input and output gradient,
``a*s*b*(2 sp h + q/t + f/t)`` inputs (QKV and first MLP linear outside the TP region, output
projection and second MLP linear inside) plus ``a*s*b*((q + 2kv)/t + 2 sp h + g f/t)`` output
gradients (``g`` = 2 with SwiGLU); :func:`w_memory_fraction` is ``M_W / M_B``, capped at 1.

How many micro-batches are alive on each rank comes from the schedule itself (the simulator's
accounting: F adds a stage's activation, B frees ``1 - w_retained_fraction`` of it, W the rest,
BW all of it), evaluated per stage class by :func:`activation_profile` so that a stage holding
the embedding or the loss weighs what it really holds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..schedules.collectives import CollectiveKind, CollectivePlan
from ..schedules.ir import OpKind
from ..schedules.lowering import lower
from ..schedules.placement import Placement
from ..schedules.schedule import Schedule
from .models import ModelSpec, ParameterCounts, parameter_counts  # re-exported: counts belong to the model

__all__ = [
    "GIB",
    "ActivationProfile",
    "ParameterCounts",
    "RankMemory",
    "TrainingSetup",
    "activation_profile",
    "bytes_per_parameter",
    "embedding_activation_bytes",
    "fsdp_rank_memory",
    "head_activation_bytes",
    "layer_activation_bytes",
    "parameter_counts",
    "rank_memory",
    "split_layers",
    "stage_layout",
    "stage_parameters",
    "w_memory_fraction",
    "wgrad_held_bytes",
]

GIB = 1024**3
PRECISIONS = ("bf16", "fp16", "fp32")
RECOMPUTE = ("none", "selective", "full")
ATTENTION = ("flash", "unfused")


@dataclass(frozen=True)
class TrainingSetup:
    """Numerics and memory-saving options shared by every configuration of a plan."""

    precision: str = "bf16"
    distributed_optimizer: bool = False
    sequence_parallel: bool = True  # used whenever TP > 1 (Megatron's --sequence-parallel)
    attention: str = "flash"  # flash (TE / fused attention) | unfused (local spec)
    w_retained_fraction: float = 1.0  # share of a stage's activation a B keeps until its W

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION)}, got {self.attention!r}")
        if not 0.0 <= self.w_retained_fraction <= 1.0:
            raise ValueError(f"w_retained_fraction must be in [0, 1], got {self.w_retained_fraction}")

    @property
    def activation_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def param_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    @property
    def grad_bytes(self) -> int:
        """Bytes of the gradient buffer per parameter (bf16 accumulates in fp32)."""
        return 2 if self.precision == "fp16" else 4

    def uses_sp(self, tp: int) -> bool:
        return self.sequence_parallel and tp > 1


def bytes_per_parameter(precision: str, distributed_optimizer: bool, data_parallel: int) -> tuple[float, float, float]:
    """``(param, grad, optimizer)`` bytes per parameter on one rank (see the module table)."""
    d = max(1, int(data_parallel))
    if precision == "bf16":
        param, grad, opt = 2.0, 4.0, 12.0  # optimizer: fp32 main params + Adam m, v
    elif precision == "fp16":
        param, grad, opt = 2.0, 2.0, 16.0  # optimizer: fp32 main params + main grads + Adam m, v
    elif precision == "fp32":
        param, grad, opt = 4.0, 4.0, 8.0  # optimizer: Adam m, v
    else:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return param, grad, opt / d if distributed_optimizer else opt


# ---- activations -----------------------------------------------------------------------------------
def layer_activation_bytes(
    model: ModelSpec, micro_batch: int, tensor_parallel: int, setup: TrainingSetup, recompute: str = "none"
) -> float:
    """Bytes one transformer layer keeps for one micro-batch until its backward."""
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}, got {recompute!r}")
    t = int(tensor_parallel)
    a = setup.activation_bytes
    s, b, h = model.seq_length, int(micro_batch), model.hidden_size
    sp = 1.0 / t if setup.uses_sp(t) else 1.0
    if recompute == "full":
        return sp * a * s * b * h
    masks = (1 if model.hidden_dropout > 0 else 0) * 2
    outside = sp * s * b * h * (4 * a + masks)
    up = 3 if model.swiglu else 2
    inside = a * s * b * (2 * model.q_size + 2 * model.kv_size) + a * s * b * model.ffn * up
    core = 0.0
    if setup.attention == "unfused" and recompute == "none":
        # softmax output; with attention dropout also its mask and output (without it there is none:
        # the CPU probe in benchmarks/bench_wgrad_memory.py measures exactly one s^2 tensor then)
        dropout = a + 1 if model.attention_dropout > 0 else 0
        core = b * model.num_attention_heads * s * s * (a + dropout)
    elif setup.attention == "flash":
        core = 4.0 * b * model.num_attention_heads * s  # softmax log-sum-exp statistic
    return outside + (inside + core) / t


def wgrad_held_bytes(model: ModelSpec, micro_batch: int, tensor_parallel: int, setup: TrainingSetup) -> float:
    """Bytes one layer's pending ``W`` keeps for one micro-batch (module doc): the deferred linears'
    inputs and output gradients."""
    t = int(tensor_parallel)
    a = setup.activation_bytes
    s, b, h = model.seq_length, int(micro_batch), model.hidden_size
    sp = 1.0 / t if setup.uses_sp(t) else 1.0
    gate = 2 if model.swiglu else 1
    inputs = 2 * sp * h + (model.q_size + model.ffn) / t
    grads = (model.q_size + 2 * model.kv_size) / t + 2 * sp * h + gate * model.ffn / t
    return a * s * b * (inputs + grads)


def w_memory_fraction(model: ModelSpec, tensor_parallel: int, setup: TrainingSetup, recompute: str = "none") -> float:
    """Share of a layer's activation a pending ``W`` keeps: ``M_W / M_B`` (paper Table 1), at most 1.

    Under full recompute ``B`` re-materialises the layer and the ``W`` then holds more than the
    checkpoint the forward kept: the share is capped at 1 (this undercounts that case)."""
    held = wgrad_held_bytes(model, 1, tensor_parallel, setup)
    kept = layer_activation_bytes(model, 1, tensor_parallel, setup, recompute)
    return min(1.0, held / kept) if kept > 0 else 1.0


def embedding_activation_bytes(model: ModelSpec, micro_batch: int, tensor_parallel: int, setup: TrainingSetup) -> float:
    """Extra bytes the first stage keeps per micro-batch: token ids and embedding dropout mask."""
    t = int(tensor_parallel)
    s, b, h = model.seq_length, int(micro_batch), model.hidden_size
    sp = 1.0 / t if setup.uses_sp(t) else 1.0
    mask = sp * s * b * h if model.hidden_dropout > 0 else 0.0
    return 8.0 * s * b + mask


def head_activation_bytes(model: ModelSpec, micro_batch: int, tensor_parallel: int, setup: TrainingSetup) -> float:
    """Extra bytes the last stage keeps per micro-batch: final norm input and output, and the
    fp32 softmax of the vocabulary-parallel cross entropy."""
    t = int(tensor_parallel)
    a = setup.activation_bytes
    s, b, h = model.seq_length, int(micro_batch), model.hidden_size
    sp = 1.0 / t if setup.uses_sp(t) else 1.0
    return 2.0 * sp * a * s * b * h + 4.0 * s * b * model.padded_vocab_size(t) / t


# ---- layer split and placement ------------------------------------------------------------------------
def split_layers(num_layers: int, num_slices: int, policy: str = "auto") -> tuple[int, ...] | None:
    """Layers of each model slice (in model order), or ``None`` if ``policy`` cannot split them.

    ``even``: ``num_layers % num_slices == 0``. ``embedding-loss`` (Megatron's
    ``--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split``, the
    zero-bubble paper's setting): the embedding and the loss count as one layer each, so the first
    and last slices get one layer less; needs ``(num_layers + 2) % num_slices == 0``. ``auto``:
    even if possible, else embedding-loss.
    """
    if num_slices < 1:
        return None
    if policy in ("even", "auto") and num_layers % num_slices == 0:
        return (num_layers // num_slices,) * num_slices
    if policy in ("embedding-loss", "auto") and num_slices >= 2 and (num_layers + 2) % num_slices == 0:
        per = (num_layers + 2) // num_slices
        if per < 2:
            return None
        return (per - 1,) + (per,) * (num_slices - 2) + (per - 1,)
    return None


@dataclass(frozen=True)
class StageInfo:
    """One global stage: its model slice, layer count and whether it holds embedding / head."""

    stage: int
    rank: int
    layers: int
    first: bool
    last: bool
    offset: int = 0  # model index of its first decoder layer
    weight: float | None = None  # activations in dense-layer units (None: ``layers``; mixed layer kinds)
    params: float | None = None  # parameters of its decoder layers per TP rank (None: ``layers`` dense layers)

    @property
    def activation_layers(self) -> float:
        return float(self.layers) if self.weight is None else self.weight


def stage_layout(placement: Placement, split: Sequence[int]) -> tuple[StageInfo, ...]:
    """Every global stage of ``placement`` with its layers (``split`` is per model slice)."""
    if len(split) != placement.stages_per_replica:
        raise ValueError(f"layer split has {len(split)} slices, the placement {placement.stages_per_replica}")
    offsets = [sum(split[:i]) for i in range(len(split))]
    out = []
    for stage in range(placement.num_stages):
        piece = placement.model_slice_of(stage)
        out.append(
            StageInfo(
                stage=stage,
                rank=placement.rank_of(stage),
                layers=int(split[piece]),
                first=placement.is_first(stage),
                last=placement.is_last(stage),
                offset=int(offsets[piece]),
            )
        )
    return tuple(out)


def stage_parameters(model: ModelSpec, tensor_parallel: int, layout: Sequence[StageInfo]) -> list[float]:
    """Parameters of each global stage (per TP rank): its layers, plus the embedding on a stage
    holding the first model slice and the final norm and output layer on one holding the last.

    With tied embeddings megatron gives the output chunk its own copy of the embedding matrix unless
    the same chunk also holds the input embedding (one-stage pipeline). V placement thus puts two
    vocabulary matrices on rank 0, a bidirectional one two on each end rank (one replica each).
    """
    counts = parameter_counts(model, tensor_parallel)
    out = []
    for info in layout:
        n = info.layers * counts.layer if info.params is None else info.params
        if info.first:
            n += counts.word_embedding + counts.position_embedding
        if info.last:
            n += counts.final_norm
            shared = info.first and not model.untie_embeddings_and_output_weights
            if not shared:
                n += counts.word_embedding
        out.append(n)
    return out


def rank_parameters(model: ModelSpec, tensor_parallel: int, layout: Sequence[StageInfo], num_ranks: int) -> list[float]:
    """Parameters each rank holds (per TP rank): the sum of its stages' (:func:`stage_parameters`)."""
    per_rank = [0.0] * num_ranks
    for info, n in zip(layout, stage_parameters(model, tensor_parallel, layout), strict=True):
        per_rank[info.rank] += n
    return per_rank


# ---- live activations per rank from the schedule --------------------------------------------------
@dataclass(frozen=True)
class ActivationProfile:
    """Per rank, the candidate peaks of live activation as ``(layers, first, last)`` counts: live
    layer-microbatches (weighted by the share still alive), live first-stage and last-stage
    micro-batches. A rank's peak bytes for per-layer size ``A``, first-stage extra ``E`` and
    last-stage extra ``O`` is ``max(A*l + E*f + O*o)`` over its candidates (exact: the live
    amount only peaks right after an F, and dominated candidates are dropped)."""

    candidates: tuple[tuple[tuple[float, float, float], ...], ...]

    def peak_bytes(self, layer: float, first: float, last: float) -> list[float]:
        return [max((layer * a + first * b + last * c for a, b, c in cands), default=0.0) for cands in self.candidates]

    def peak_layers(self) -> list[float]:
        """Peak live layer-microbatches per rank (ignoring the embedding / head extras)."""
        return [max((c[0] for c in cands), default=0.0) for cands in self.candidates]


def activation_profile(
    schedule: Schedule, layout: Sequence[StageInfo], w_retained_fraction: float
) -> ActivationProfile:
    """Walk every rank's ops with the simulator's memory accounting, per stage class."""
    retained = float(w_retained_fraction)
    freed_by_b = 1.0 - retained
    f_kind, b_kind, bw_kind = OpKind.F, OpKind.B, OpKind.BW
    weights = [(i.activation_layers, 1.0 if i.first else 0.0, 1.0 if i.last else 0.0) for i in layout]
    result = []
    for row in schedule.ops:
        ln = fn = on = 0.0
        cands: list[tuple[float, float, float]] = []
        for op in row:
            wl, wf, wo = weights[op.stage]
            kind = op.kind
            if kind is f_kind:
                ln += wl
                fn += wf
                on += wo
                cands.append((ln, fn, on))
            else:
                share = 1.0 if kind is bw_kind else freed_by_b if kind is b_kind else retained
                ln -= share * wl
                fn -= share * wf
                on -= share * wo
        result.append(_pareto(cands))
    return ActivationProfile(tuple(result))


def _pareto(cands: list[tuple[float, float, float]]) -> tuple[tuple[float, float, float], ...]:
    """Drop candidates dominated in every component by another one."""
    unique = sorted(set(cands), reverse=True)
    kept: list[tuple[float, float, float]] = []
    for c in unique:
        if not any(k[0] >= c[0] and k[1] >= c[1] and k[2] >= c[2] for k in kept):
            kept.append(c)
    return tuple(kept)


# ---- everything together ----------------------------------------------------------------------------
@dataclass(frozen=True)
class RankMemory:
    """Bytes on one rank."""

    rank: int
    parameters: float  # count, per TP rank
    weights: float
    gradients: float
    optimizer: float
    activations: float  # peak live activations of the schedule
    transient: float  # working set not held across ops (full-recompute rematerialisation)
    p2p_buffers: float = 0.0  # receive buffers posted ahead and pending sends (p2p_buffer_bytes)

    @property
    def static(self) -> float:
        return self.weights + self.gradients + self.optimizer

    @property
    def total(self) -> float:
        return self.static + self.activations + self.transient + self.p2p_buffers

    def to_json_dict(self) -> dict[str, float]:
        return {
            "rank": self.rank,
            "parameters": round(self.parameters),
            "weights_gib": round(self.weights / GIB, 4),
            "gradients_gib": round(self.gradients / GIB, 4),
            "optimizer_gib": round(self.optimizer / GIB, 4),
            "activations_gib": round(self.activations / GIB, 4),
            "transient_gib": round(self.transient / GIB, 4),
            "p2p_buffers_gib": round(self.p2p_buffers / GIB, 4),
            "total_gib": round(self.total / GIB, 4),
        }


def static_memory(
    model: ModelSpec,
    setup: TrainingSetup,
    tensor_parallel: int,
    data_parallel: int,
    layout: Sequence[StageInfo],
    num_ranks: int,
) -> list[tuple[float, float, float, float]]:
    """Per rank ``(parameters, weight bytes, gradient bytes, optimizer bytes)``."""
    params = rank_parameters(model, tensor_parallel, layout, num_ranks)
    pb, gb, ob = bytes_per_parameter(setup.precision, setup.distributed_optimizer, data_parallel)
    return [(n, n * pb, n * gb, n * ob) for n in params]


def rank_memory(
    model: ModelSpec,
    setup: TrainingSetup,
    *,
    tensor_parallel: int,
    data_parallel: int,
    micro_batch: int,
    recompute: str,
    schedule: Schedule,
    split: Sequence[int],
    profile: ActivationProfile | None = None,
    layout: Sequence[StageInfo] | None = None,
) -> list[RankMemory]:
    """Per-rank memory of ``schedule`` (its placement and op order) for this configuration; ``layout``: the
    stages with their layer kinds' weights (:func:`.layer_costs.kind_layout`), default plain dense layers."""
    if layout is None:
        layout = stage_layout(schedule.placement, split)
    if profile is None:
        profile = activation_profile(schedule, layout, setup.w_retained_fraction)
    static = static_memory(model, setup, tensor_parallel, data_parallel, layout, schedule.num_ranks)
    a_layer = layer_activation_bytes(model, micro_batch, tensor_parallel, setup, recompute)
    a_first = embedding_activation_bytes(model, micro_batch, tensor_parallel, setup)
    a_last = head_activation_bytes(model, micro_batch, tensor_parallel, setup)
    peaks = profile.peak_bytes(a_layer, a_first, a_last)
    transient = 0.0
    if recompute == "full":
        transient = layer_activation_bytes(model, micro_batch, tensor_parallel, setup, "none")
    buffers = p2p_buffer_bytes(model, micro_batch, tensor_parallel, setup, schedule)
    return [
        RankMemory(
            rank=r,
            parameters=n,
            weights=w,
            gradients=g,
            optimizer=o,
            activations=peaks[r],
            transient=transient,
            p2p_buffers=buffers[r],
        )
        for r, (n, w, g, o) in enumerate(static)
    ]


def p2p_buffer_bytes(
    model: ModelSpec, micro_batch: int, tensor_parallel: int, setup: TrainingSetup, schedule: Schedule
) -> list[float]:
    """Per rank, bytes of the p2p buffers the executor holds beyond activations: receive buffers
    posted ahead of their consumer and pending sends (``LoweredSchedule.buffer_counts``), each one
    pipeline message (``seq x micro-batch x hidden``, split by TP under sequence parallelism)."""
    t = int(tensor_parallel)
    message: float = model.seq_length * int(micro_batch) * model.hidden_size * setup.activation_bytes
    if setup.uses_sp(t):
        message /= t
    return [count * message for count in lower(schedule).buffer_counts]


# ---- FSDP inside the pipeline ----------------------------------------------------------------------
def fsdp_rank_memory(
    setup: TrainingSetup,
    data_parallel: int,
    plan: CollectivePlan,
    stage_params: Sequence[float],
    activations: Sequence[RankMemory],
) -> list[RankMemory]:
    """Per-rank memory with FSDP inside the pipeline (``--pipeline-fsdp``), from the collective plan
    the lowering derives (:func:`~megatron_pp_ext.schedules.collectives.derive_collectives` with the
    schedule's declared gathered-chunk limit) and ``activations`` (the plain model's rows, whose
    activations and transient are kept).

    * Sharded state: a rank's ``P`` parameters keep ``(param + grad + optimizer) / d`` bytes each
      (:func:`bytes_per_parameter` without the distributed optimizer, divided by ``d``).
    * Gathered parameters: a chunk's full parameters (``param`` bytes each) from its ``unshard`` to its
      ``reshard``, at most the declared limit of chunks at once.
    * Full gradient buffers: as :class:`megatron_pp_ext.runtime.fsdp.ShardedChunk` does, a chunk's
      full-size gradient buffer (``grad`` bytes per parameter) is allocated at its first gradient op
      of the iteration and freed when its reduce-scatter is waited for, in the finalize step at the end
      of the iteration: once every chunk had a backward, the rank holds all of them.

    The working set counted is the peak, over the rank's ops, of gathered parameters plus live full
    gradient buffers; it is added to ``weights`` (gathered) and ``gradients`` (full buffers) at that peak.
    """
    d = max(1, int(data_parallel))
    pb, gb, ob = bytes_per_parameter(setup.precision, False, 1)
    schedule = plan.schedule
    out = []
    for rank, ops in enumerate(schedule.ops):
        by_gap = plan.on_rank(rank)
        gathered: set[int] = set()
        grads: set[int] = set()
        best = (0.0, 0.0)
        for i, op in enumerate(ops):
            for c in by_gap.get(i, ()):
                if c.kind == CollectiveKind.UNSHARD:
                    gathered.add(c.stage)
                elif c.kind == CollectiveKind.RESHARD:
                    gathered.discard(c.stage)
            if op.kind in (OpKind.B, OpKind.W, OpKind.BW):
                grads.add(op.stage)
            held = (pb * sum(stage_params[s] for s in gathered), gb * sum(stage_params[s] for s in grads))
            if sum(held) > sum(best):
                best = held
        base = activations[rank]
        n = base.parameters
        out.append(
            RankMemory(
                rank=rank,
                parameters=n,
                weights=n * pb / d + best[0],
                gradients=n * gb / d + best[1],
                optimizer=n * ob / d,
                activations=base.activations,
                transient=base.transient,
                p2p_buffers=base.p2p_buffers,
            )
        )
    return out
