"""Per-layer costs: the time (``F``, ``B``, ``W``), kept activations and parameters of each kind of layer a
model is built from, and the per-stage simulator costs and memory weights of a layer layout.

A model is the sequence ``embedding, decoder layers (model.layer_kinds()), output layer + loss``. A
layout gives each model slice a contiguous run of it (the embedding always in the first slice, the loss
in the last, as megatron builds them); the pipeline's stage costs are the sums over each slice. Kinds:

* ``dense``: attention + MLP; exactly :meth:`.cost_model.CostModel.layer_times` (and its measured times);
* ``moe``: attention + a MoE MLP (``topk`` routed experts of width ``moe_ffn_hidden_size``, the shared
  experts, the router GEMM; no expert parallelism, so no all-to-all; one kernel overhead more per pass
  for the token dispatcher);
* ``attention``, ``mlp``, ``moe-mlp``, ``mamba``: the one-mixer layers of a hybrid model (megatron's
  ``M * - E``). A Mamba-2 mixer (expand 2, ``mamba_state_dim``, ``mamba_head_dim``, ``mamba_num_groups``)
  costs its in/out projections as GEMMs plus a scan of ``6 s b d_inner d_state`` FLOPs timed like core
  attention (``B`` twice the forward, no ``W``): a rough figure, give measured times when it matters;
* ``embedding``: a memory-bound lookup (forward: write ``s b h`` activations, its weight gradient: read
  them and scatter-add; no input gradient) plus, with TP, the vocabulary-parallel all-reduce;
* ``head``: output layer + cross entropy, :meth:`.cost_model.CostModel.head_times` (``2 s b h V`` per pass).

TP collectives are added per mixer (two per ``dense`` / ``moe`` layer, one per hybrid layer), as
:meth:`.cost_model.CostModel.tp_comm_per_layer` counts them. Measured per-kind times
(``--layer-costs``, parsed by :func:`megatron_pp_ext.schedules.values.parse_layer_costs`) replace the
model's estimate for those kinds, scaled linearly in micro-batch size and ``1/TP`` like
:meth:`.cost_model.CostModel.with_measured_layer_times`.

Activations per kind (bytes kept per micro-batch until the backward) follow
:func:`.memory.layer_activation_bytes`: ``dense`` is exactly it; a one-mixer layer keeps its half of the
outside-TP tensors and its own inside tensors; a MoE MLP keeps ``topk`` copies of the routed tokens and
each expert's intermediate. They enter the memory model as each stage's weight in dense-layer units
(the ratio at the candidate's TP and micro-batch), so :func:`.memory.activation_profile` stays one walk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..schedules.costs import Costs
from ..schedules.placement import Placement
from ..schedules.values import layer_costs_scale
from .cost_model import CostModel, LayerTimes, flop_times, kind_flops, recomputed_backward
from .memory import StageInfo, TrainingSetup, layer_activation_bytes, stage_layout
from .models import ModelSpec, kind_parameters

__all__ = [
    "LayerCostTable",
    "MeasuredLayers",
    "kind_activation_bytes",
    "kind_flops",
    "kind_layout",
    "layer_cost_table",
    "slice_costs",
    "stage_costs",
]

# mixers per kind: the TP collectives (two per GPT layer) and kernel overheads a pass pays
_MIXERS = {"dense": 2, "moe": 2, "attention": 1, "mlp": 1, "moe-mlp": 1, "mamba": 1}


def kind_activation_bytes(
    model: ModelSpec, kind: str, micro_batch: int, tensor_parallel: int, setup: TrainingSetup, recompute: str = "none"
) -> float:
    """Bytes one layer of ``kind`` keeps for one micro-batch until its backward (module doc)."""
    dense = layer_activation_bytes(model, micro_batch, tensor_parallel, setup, recompute)
    if kind == "dense":
        return dense
    t = int(tensor_parallel)
    a = setup.activation_bytes
    s, b, h = model.seq_length, int(micro_batch), model.hidden_size
    sp = 1.0 / t if setup.uses_sp(t) else 1.0
    if recompute == "full":
        return sp * a * s * b * h
    half_outside = sp * s * b * h * (2 * a + (1 if model.hidden_dropout > 0 else 0))
    up = 3 if model.swiglu else 2
    mlp_inside = a * s * b * model.ffn * up / t
    attention = dense - 2 * half_outside - mlp_inside + half_outside  # dense = 2 outsides + attention + MLP inside
    routed = model.moe_router_topk * (a * s * b * h + a * s * b * model.expert_ffn * up) / t
    shared = a * s * b * model.moe_shared_expert_ffn * up / t
    moe_mlp = half_outside + routed + shared + 4.0 * s * b * (model.num_experts or 0)  # + fp32 router probabilities
    if kind == "moe":
        return attention + moe_mlp
    if kind == "attention":
        return attention
    if kind == "mlp":
        return half_outside + mlp_inside
    if kind == "moe-mlp":
        return moe_mlp
    if kind == "mamba":
        di, groups, state = 2 * h, model.mamba_num_groups, model.mamba_state_dim
        return sp * a * s * b * h + a * s * b * (4 * di + 2 * groups * state) / t
    raise ValueError(f"unknown layer kind {kind!r}")


@dataclass(frozen=True)
class MeasuredLayers:
    """Measured per-kind times (seconds of one layer for one micro-batch) at ``micro_batch`` and ``tp``."""

    times: tuple[tuple[str, LayerTimes], ...]
    micro_batch: int = 1
    tp: int = 1

    @classmethod
    def from_ms(cls, entries: dict[str, tuple[float, float, float]], micro_batch: int, tp: int) -> MeasuredLayers:
        """From :func:`megatron_pp_ext.schedules.values.parse_layer_costs`'s result (milliseconds)."""
        times = tuple((k, LayerTimes(f * 1e-3, b * 1e-3, w * 1e-3)) for k, (f, b, w) in sorted(entries.items()))
        return cls(times, micro_batch, tp)

    def get(self, kind: str, micro_batch: int, tensor_parallel: int) -> LayerTimes | None:
        for name, times in self.times:
            if name == kind:
                scale = layer_costs_scale(micro_batch, tensor_parallel, self.micro_batch, self.tp)
                return LayerTimes(times.f * scale, times.b * scale, times.w * scale)
        return None


@dataclass(frozen=True)
class LayerCostTable:
    """Times of every layer of a model for one candidate (micro-batch, TP, recompute): the embedding, each
    decoder layer in model order, the head; TP collectives included."""

    embedding: LayerTimes
    layers: tuple[LayerTimes, ...]
    head: LayerTimes

    def sequence(self) -> list[LayerTimes]:
        """``embedding, layers..., head``: the sequence a layout cuts into slices."""
        return [self.embedding, *self.layers, self.head]


def _kind_times(
    cost: CostModel, kind: str, micro_batch: int, tensor_parallel: int, recompute: str, measured: MeasuredLayers | None
) -> LayerTimes:
    t = int(tensor_parallel)
    comm_f, comm_b = cost.tp_comm_per_layer(micro_batch, t)
    share = _MIXERS[kind] / 2
    comm_f, comm_b = comm_f * share, comm_b * share
    known = measured.get(kind, micro_batch, t) if measured is not None else None
    if known is not None:
        f, b, w = known.f, known.b, known.w
        gemm, core = kind_flops(cost.model, kind, micro_batch)
        core_f = f * core / (gemm + core) if gemm + core else 0.0
    elif kind == "dense":
        lt = cost.layer_times(micro_batch, t, "none")
        f, b, w = lt.f, lt.b, lt.w
        gemm, core = kind_flops(cost.model, kind, micro_batch)
        core_f = f * core / (gemm + core) if cost.measured is not None else core / _rate(cost, micro_batch, t)
    else:
        gemm, core = kind_flops(cost.model, kind, micro_batch)
        overhead = cost.device.kernel_overhead_us * 1e-6 * (share if kind != "moe" else 1.5)
        f, b, w, core_f = flop_times(gemm, core, _rate(cost, micro_batch, t), overhead)
    b = recomputed_backward(f, b, core_f, recompute)
    if recompute == "full":
        comm_b += comm_f
    return LayerTimes(f + comm_f, b + comm_b, w)


def _rate(cost: CostModel, micro_batch: int, tensor_parallel: int) -> float:
    """FLOP/s of one TP group on this model's GEMMs (:meth:`.cost_model.CostModel.layer_times`'s)."""
    return cost.gemm_rate(micro_batch, tensor_parallel) * tensor_parallel


def _embedding_times(cost: CostModel, micro_batch: int, tensor_parallel: int) -> LayerTimes:
    t = int(tensor_parallel)
    model, setup = cost.model, cost.setup
    volume = model.seq_length * micro_batch * model.hidden_size * setup.activation_bytes
    hbm = cost.device.hbm_gbps * 1e9
    overhead = cost.device.kernel_overhead_us * 1e-6
    comm_f, _ = cost.tp_comm_per_layer(micro_batch, t)
    return LayerTimes(volume / hbm + overhead + comm_f / 2, 0.0, 2 * volume / hbm + overhead)


def layer_cost_table(
    cost: CostModel, micro_batch: int, tensor_parallel: int, recompute: str, measured: MeasuredLayers | None = None
) -> LayerCostTable:
    """Every layer's times for one candidate (see the module doc)."""
    kinds = cost.model.layer_kinds()
    per_kind = {k: _kind_times(cost, k, micro_batch, tensor_parallel, recompute, measured) for k in set(kinds)}
    embedding = measured.get("embedding", micro_batch, tensor_parallel) if measured is not None else None
    head = measured.get("head", micro_batch, tensor_parallel) if measured is not None else None
    return LayerCostTable(
        embedding=embedding or _embedding_times(cost, micro_batch, tensor_parallel),
        layers=tuple(per_kind[k] for k in kinds),
        head=head or cost.head_times(micro_batch, tensor_parallel),
    )


def slice_costs(table: LayerCostTable, split: Sequence[int]) -> list[LayerTimes]:
    """``F, B, W`` of each model slice of ``split`` (layers per slice, model order; the embedding in the
    first slice, the head in the last)."""
    out = []
    offset = 0
    for i, n in enumerate(split):
        run = table.layers[offset : offset + n]
        offset += n
        f = (
            sum(x.f for x in run)
            + (table.embedding.f if i == 0 else 0.0)
            + (table.head.f if i == len(split) - 1 else 0.0)
        )
        b = (
            sum(x.b for x in run)
            + (table.embedding.b if i == 0 else 0.0)
            + (table.head.b if i == len(split) - 1 else 0.0)
        )
        w = (
            sum(x.w for x in run)
            + (table.embedding.w if i == 0 else 0.0)
            + (table.head.w if i == len(split) - 1 else 0.0)
        )
        out.append(LayerTimes(f, b, w))
    if offset != len(table.layers):
        raise ValueError(f"layer split {tuple(split)} holds {offset} layers, the model has {len(table.layers)}")
    return out


def stage_costs(table: LayerCostTable, layout: Sequence[StageInfo], placement: Placement, comm: float) -> Costs:
    """The simulator's per-stage costs of ``layout`` (its stages' slices) and the hop time ``comm``."""
    split = [0] * placement.stages_per_replica
    for info in layout:
        split[placement.model_slice_of(info.stage)] = info.layers
    per_slice = slice_costs(table, split)
    chosen = [per_slice[placement.model_slice_of(info.stage)] for info in layout]
    return Costs(tuple(x.f for x in chosen), tuple(x.b for x in chosen), tuple(x.w for x in chosen), None, float(comm))


def kind_layout(
    model: ModelSpec,
    setup: TrainingSetup,
    placement: Placement,
    split: Sequence[int],
    tensor_parallel: int,
    micro_batch: int,
    recompute: str,
) -> tuple[StageInfo, ...]:
    """:func:`.memory.stage_layout` with each stage's activation weight (dense-layer units) and decoder
    parameters from its layers' kinds; the plain layout for a model of dense layers only."""
    layout = stage_layout(placement, split)
    if model.uniform_layers:
        return layout
    kinds = model.layer_kinds()
    dense = layer_activation_bytes(model, micro_batch, tensor_parallel, setup, recompute)
    act = {
        k: kind_activation_bytes(model, k, micro_batch, tensor_parallel, setup, recompute) / dense for k in set(kinds)
    }
    params = {k: kind_parameters(model, k, tensor_parallel) for k in set(kinds)}
    out = []
    for info in layout:
        mine = kinds[info.offset : info.offset + info.layers]
        out.append(
            StageInfo(
                info.stage,
                info.rank,
                info.layers,
                info.first,
                info.last,
                info.offset,
                weight=sum(act[k] for k in mine),
                params=sum(params[k] for k in mine),
            )
        )
    return tuple(out)
