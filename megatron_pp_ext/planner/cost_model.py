"""Cost model: per-stage ``T_F``, ``T_B``, ``T_W`` from FLOPs and a device profile, plus
communication (TP collectives, PP p2p, DP gradient reduction) and the optimizer step.

Compute: a layer's forward FLOPs (``2*`` every GEMM's ``m*n*k``, core attention ``QK^T`` and
``softmax V`` halved for the causal mask, as megatron's ``num_floating_point_operations`` counts
them) run at ``peak * efficiency * x / (x + gemm_knee)`` where ``x = micro_batch * seq * hidden / TP``
is the size of one GEMM's activation operand: small GEMMs (small micro-batches, large TP) run
further from peak. With the default knee (``0.5M`` elements) doubling the micro-batch of a
``h=5120, s=1024`` layer from 1 to 2 gains 6% and from 3 to 6 about 2%, and TP 8 runs at 0.6x of
TP 1's rate, close to what the zero-bubble (Table 7) and controllable-memory (Fig. 12) papers
measured. A fixed ``kernel_overhead_us`` per layer and pass is added. ``B``
(input gradients) costs the GEMMs once more plus core attention twice; ``W`` (weight
gradients) the GEMMs once more. Selective recompute adds core attention's forward to ``B``, full
recompute the layer's whole forward. The last stage adds the output layer (``2*s*b*h*V``
forward, the same for each backward part) and the cross entropy.

Communication (``alpha``-``beta`` model: ``latency + bytes / bandwidth``):

* TP: per layer two all-reduces of ``s*b*h`` activations in the forward and two in ``B``
  (with sequence parallelism, all-gather + reduce-scatter of the same volume), ring volume
  ``2(t-1)/t``, not overlapped; on NVLink when ``t <= gpus_per_node``;
* PP: one ``s*b*h`` activation (``/t`` with sequence parallelism) per hop, on NVLink when the
  whole pipeline group fits in a node (Megatron's rank order is TP, DP, PP: neighbours are
  ``t*d`` ranks apart), otherwise over the network; becomes the simulator's ``t_comm``;
* DP: gradient all-reduce (or reduce-scatter + parameter all-gather with the distributed
  optimizer) of the rank's gradient buffer after the last backward, ``dp_overlap`` of it hidden;
  on NVLink when ``t*d <= gpus_per_node``;
* optimizer step: memory bound, ``~36 bytes`` per parameter the rank updates at HBM bandwidth.

Device presets (dense tensor-core peak, HBM bandwidth, per-GPU NVLink / network bandwidth) are
the vendors' datasheet figures; ``efficiency`` (share of peak large GEMMs reach) is calibrated
for the A100 on the zero-bubble paper's measured 1F1B throughput and assumed for the others; the
achievable bandwidths and the latencies are assumptions. Calibrate with ``--efficiency``, or
measured layer times with :meth:`CostModel.with_measured_layer_times`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..schedules.costs import Costs
from .memory import StageInfo, TrainingSetup, bytes_per_parameter
from .models import ModelSpec

__all__ = ["DEVICES", "CostModel", "Device", "LayerTimes", "get_device", "model_flops_per_iteration"]


@dataclass(frozen=True)
class Device:
    """One accelerator model and the network around it."""

    name: str
    peak_tflops: float  # dense bf16/fp16 tensor-core peak per GPU
    fp32_tflops: float  # peak for fp32 training (TF32 tensor cores where they exist)
    memory_gib: float
    hbm_gbps: float  # HBM bandwidth, GB/s
    intra_gbps: float  # achievable per-GPU NVLink bus bandwidth, GB/s (one direction)
    inter_gbps: float  # achievable per-GPU network bandwidth between nodes, GB/s
    intra_latency_us: float = 10.0
    inter_latency_us: float = 25.0
    gpus_per_node: int = 8
    efficiency: float = 0.7  # share of peak large transformer GEMMs reach (assumed; calibrate)
    kernel_overhead_us: float = 30.0  # fixed cost per layer per pass (launches, small kernels)
    gemm_knee: float = 5e5  # GEMM operand size (elements) at which efficiency is half its peak share
    source: str = ""

    def tflops(self, precision: str) -> float:
        return self.fp32_tflops if precision == "fp32" else self.peak_tflops


DEVICES: dict[str, Device] = {
    d.name.lower(): d
    for d in (
        Device(
            "A100-80GB",
            312.0,
            156.0,
            80.0,
            2039.0,
            240.0,
            20.0,
            efficiency=0.62,
            source="NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOP/s bf16 dense, 156 TF32, 2039 GB/s HBM2e, "
            "NVLink3 600 GB/s total; network 200 Gb/s HDR per GPU. Efficiency calibrated on the zero-bubble "
            "paper's 6.2B 1F1B run (p=8, m=32: 3.70 samples/s/GPU, Table 4)",
        ),
        Device(
            "H100-80GB",
            989.0,
            494.0,
            80.0,
            3350.0,
            360.0,
            40.0,
            efficiency=0.55,
            source="NVIDIA H100 SXM5 datasheet: 989 TFLOP/s bf16 dense, 494 TF32, 3.35 TB/s HBM3, "
            "NVLink4 900 GB/s total; network 400 Gb/s NDR per GPU",
        ),
        Device(
            "H200",
            989.0,
            494.0,
            141.0,
            4800.0,
            360.0,
            40.0,
            efficiency=0.55,
            source="NVIDIA H200 SXM datasheet: 989 TFLOP/s bf16 dense, 141 GB HBM3e at 4.8 TB/s, "
            "NVLink4 900 GB/s total; network 400 Gb/s NDR per GPU",
        ),
        Device(
            "V100-32GB",
            125.0,
            15.7,
            32.0,
            900.0,
            130.0,
            10.0,
            efficiency=0.6,
            intra_latency_us=15.0,
            source="NVIDIA V100 SXM2 32GB datasheet: 125 TFLOP/s fp16 tensor (no bf16), 15.7 fp32, "
            "900 GB/s HBM2, NVLink2 300 GB/s total; network 100 Gb/s EDR per GPU",
        ),
        Device(
            "CPU",
            0.05,
            0.05,
            64.0,
            20.0,
            2.0,
            1.0,
            intra_latency_us=200.0,
            inter_latency_us=500.0,
            gpus_per_node=2,
            efficiency=0.5,
            kernel_overhead_us=6000.0,
            gemm_knee=1e4,
            source="this CPU machine under gloo (rough; for the local launcher only)",
        ),
    )
}


def get_device(name: str) -> Device:
    key = str(name).strip().lower()
    if key not in DEVICES:
        raise ValueError(f"unknown device {name!r}; presets: {', '.join(d.name for d in DEVICES.values())}")
    return DEVICES[key]


@dataclass(frozen=True)
class LayerTimes:
    """Seconds of one transformer layer for one micro-batch (compute only, no TP comm)."""

    f: float
    b: float
    w: float


def flop_times(gemm: float, core: float, rate: float, overhead: float) -> tuple[float, float, float, float]:
    """A layer's F, B, W seconds from its GEMM and core-attention FLOPs at ``rate`` FLOP/s (B: the input
    gradient of both, W: the GEMMs' weight gradient; ``overhead`` per pass), and its core attention's F."""
    return (gemm + core) / rate + overhead, (gemm + 2 * core) / rate + overhead, gemm / rate + overhead, core / rate


def recomputed_backward(f: float, b: float, core_f: float, recompute: str) -> float:
    """B with the forward it recomputes: the core attention (``selective``) or the whole layer (``full``)."""
    if recompute == "selective":
        return b + core_f
    if recompute == "full":
        return b + f
    return b


def layer_flops(model: ModelSpec, micro_batch: int) -> tuple[float, float]:
    """Forward FLOPs of one layer for one micro-batch: ``(GEMMs, core attention)`` (whole layer,
    not divided by TP)."""
    s, b, h = model.seq_length, int(micro_batch), model.hidden_size
    up = 2 * model.ffn if model.swiglu else model.ffn
    gemm = 2.0 * s * b * (h * (model.q_size + 2 * model.kv_size) + model.q_size * h + h * up + model.ffn * h)
    core = 2.0 * s * s * b * model.q_size  # QK^T and softmax V, causal halves each
    return gemm, core


def logits_flops(model: ModelSpec, micro_batch: int) -> float:
    """Output layer of one micro-batch (megatron counts the padded vocabulary)."""
    return 2.0 * model.seq_length * micro_batch * model.hidden_size * model.padded_vocab_size(1)


def _mlp_gemm(model: ModelSpec, width: int, tokens: float) -> float:
    up = 2 * width if model.swiglu else width
    return 2.0 * tokens * (model.hidden_size * up + width * model.hidden_size)


def kind_flops(model: ModelSpec, kind: str, micro_batch: int) -> tuple[float, float]:
    """Forward FLOPs of one layer of ``kind`` for one micro-batch: ``(GEMMs, core)`` where core (core
    attention, the Mamba scan) costs twice the forward in ``B`` and nothing in ``W``."""
    if kind == "dense":
        return layer_flops(model, micro_batch)
    s, b, h = model.seq_length, int(micro_batch), model.hidden_size
    tokens = float(s * b)
    attention = 2.0 * tokens * (h * (model.q_size + 2 * model.kv_size) + model.q_size * h)
    core = 2.0 * s * s * b * model.q_size
    experts = model.moe_router_topk * _mlp_gemm(model, model.expert_ffn, tokens)
    experts += _mlp_gemm(model, model.moe_shared_expert_ffn, tokens) + 2.0 * tokens * h * (model.num_experts or 0)
    if kind == "moe":
        return attention + experts, core
    if kind == "attention":
        return attention, core
    if kind == "mlp":
        return _mlp_gemm(model, model.ffn, tokens), 0.0
    if kind == "moe-mlp":
        return experts, 0.0
    if kind == "mamba":
        di, groups, state = 2 * h, model.mamba_num_groups, model.mamba_state_dim
        heads = di // model.mamba_head_dim
        gemm = 2.0 * tokens * (h * (2 * di + 2 * groups * state + heads) + di * h)
        return gemm, 6.0 * tokens * di * state
    raise ValueError(f"unknown layer kind {kind!r}")


def model_flops_per_iteration(model: ModelSpec, global_batch: int) -> float:
    """Model FLOPs of one iteration (3x forward; recompute not counted), as megatron's
    ``num_floating_point_operations`` counts them for a dense GPT; a MoE or hybrid model's layers each by
    their kind (:func:`kind_flops`: the routed experts' top-k, one mixer per hybrid layer)."""
    layers = sum(sum(kind_flops(model, kind, global_batch)) for kind in model.layer_kinds())
    return 3.0 * (layers + logits_flops(model, global_batch))


def _ring_time(volume_bytes: float, group: int, gbps: float, latency_us: float, factor: float) -> float:
    """Ring collective: ``factor * (group-1)/group * volume`` over the link, plus latency per step."""
    if group <= 1 or volume_bytes <= 0:
        return 0.0
    return factor * (group - 1) / group * volume_bytes / (gbps * 1e9) + (group - 1) * latency_us * 1e-6


@dataclass(frozen=True)
class CostModel:
    """Turns a configuration into simulator costs and the non-pipeline parts of an iteration."""

    model: ModelSpec
    device: Device
    setup: TrainingSetup
    efficiency: float | None = None  # overrides the device's
    dp_overlap: float = 0.0  # share of the DP gradient reduction hidden behind the backward
    gemm_knee: float | None = None  # overrides the device's
    measured: LayerTimes | None = None  # per-layer times at measured_micro_batch / measured_tp
    measured_micro_batch: int = 1
    measured_tp: int = 1

    def with_measured_layer_times(self, times: LayerTimes, micro_batch: int, tensor_parallel: int) -> CostModel:
        """Use times measured for one layer (scaled linearly in micro-batch size and 1/TP)."""
        return replace(self, measured=times, measured_micro_batch=micro_batch, measured_tp=tensor_parallel)

    # ---- compute -----------------------------------------------------------------------------
    def gemm_rate(self, micro_batch: int, tensor_parallel: int) -> float:
        """FLOP/s one GPU reaches on this model's GEMMs at this micro-batch and TP size."""
        return self._rate(micro_batch, tensor_parallel)

    def _rate(self, micro_batch: int, tensor_parallel: int) -> float:
        """FLOP/s one GPU reaches on this layer's GEMMs."""
        eff = self.efficiency if self.efficiency is not None else self.device.efficiency
        x = micro_batch * self.model.seq_length * self.model.hidden_size / max(1, tensor_parallel)
        knee = self.device.gemm_knee if self.gemm_knee is None else self.gemm_knee
        return self.device.tflops(self.setup.precision) * 1e12 * eff * x / (x + knee)

    def layer_times(self, micro_batch: int, tensor_parallel: int, recompute: str) -> LayerTimes:
        """Compute time of one layer for one micro-batch on one TP rank (recompute included)."""
        t = int(tensor_parallel)
        if self.measured is not None:
            scale = (micro_batch / self.measured_micro_batch) * (self.measured_tp / t)
            f, b, w = self.measured.f * scale, self.measured.b * scale, self.measured.w * scale
            core_f = 0.0
            if recompute != "none":
                gemm, core = layer_flops(self.model, micro_batch)
                core_f = f * core / (gemm + core)
        else:
            gemm, core = layer_flops(self.model, micro_batch)
            rate = self._rate(micro_batch, t) * t
            f, b, w, core_f = flop_times(gemm, core, rate, self.device.kernel_overhead_us * 1e-6)
        return LayerTimes(f, recomputed_backward(f, b, core_f, recompute), w)

    def head_times(self, micro_batch: int, tensor_parallel: int) -> LayerTimes:
        """Output layer + cross entropy on the last stage (its B and W each cost one GEMM)."""
        rate = self._rate(micro_batch, tensor_parallel) * tensor_parallel
        x = logits_flops(self.model, micro_batch) / rate
        overhead = self.device.kernel_overhead_us * 1e-6
        return LayerTimes(x + overhead, x + overhead, x)

    # ---- communication -------------------------------------------------------------------------
    def _link(self, group_span: int) -> tuple[float, float]:
        """``(GB/s, latency us)`` of a group spanning ``group_span`` consecutive ranks."""
        gpn = self.device.gpus_per_node
        if group_span <= gpn and gpn % group_span == 0:
            return self.device.intra_gbps, self.device.intra_latency_us
        return self.device.inter_gbps, self.device.inter_latency_us

    def tp_comm_per_layer(self, micro_batch: int, tensor_parallel: int) -> tuple[float, float]:
        """Seconds of TP collectives of one layer: ``(forward, input-gradient backward)``."""
        t = int(tensor_parallel)
        if t <= 1:
            return 0.0, 0.0
        volume = self.model.seq_length * micro_batch * self.model.hidden_size * self.setup.activation_bytes
        gbps, lat = self._link(t)
        one = _ring_time(volume, t, gbps, lat, 2.0)  # all-reduce = reduce-scatter + all-gather
        return 2 * one, 2 * one

    def p2p_time(self, micro_batch: int, tensor_parallel: int, pipeline: int, data_parallel: int) -> float:
        """One pipeline hop (activation or gradient of one micro-batch)."""
        if pipeline <= 1:
            return 0.0
        t = int(tensor_parallel)
        volume: float = self.model.seq_length * micro_batch * self.model.hidden_size * self.setup.activation_bytes
        if self.setup.uses_sp(t):
            volume /= t
        gbps, lat = self._link(t * data_parallel * pipeline)
        return lat * 1e-6 + volume / (gbps * 1e9)

    def dp_bandwidth(self, tensor_parallel: int, data_parallel: int) -> float:
        """Bytes per second of one rank's link in its data-parallel group (the simulator's ``dp_bandwidth``)."""
        gbps, _ = self._link(int(tensor_parallel) * int(data_parallel))
        return gbps * 1e9

    def dp_time(self, parameters_on_rank: float, tensor_parallel: int, data_parallel: int) -> float:
        """Gradient reduction after the last backward (not hidden by ``dp_overlap``)."""
        d = int(data_parallel)
        if d <= 1:
            return 0.0
        gbps, lat = self._link(tensor_parallel * d)
        grads = parameters_on_rank * self.setup.grad_bytes
        if self.setup.distributed_optimizer:
            seconds = _ring_time(grads, d, gbps, lat, 1.0)  # reduce-scatter
            seconds += _ring_time(parameters_on_rank * self.setup.param_bytes, d, gbps, lat, 1.0)  # all-gather
        else:
            seconds = _ring_time(grads, d, gbps, lat, 2.0)
        return seconds * (1.0 - self.dp_overlap)

    def replica_sync_time(
        self, parameters_on_rank: float, tensor_parallel: int, pipeline: int, data_parallel: int = 1
    ) -> float:
        """Bidirectional placements: the all-reduce (sum) of every local chunk's gradients with the
        mirror rank's copy (each rank holds both copies of its model slices: all its gradients take
        part). Whole, not discounted: how much of it the pipeline hides is the data-parallel stream's
        business (:mod:`.dp_stream`, each chunk's sync issued after its last backward)."""
        gbps, lat = self._link(tensor_parallel * data_parallel * pipeline)  # mirror ranks lie p-1-2r apart
        return _ring_time(parameters_on_rank * self.setup.grad_bytes, 2, gbps, lat, 2.0)

    def optimizer_time(self, parameters_on_rank: float, data_parallel: int) -> float:
        updated = parameters_on_rank / data_parallel if self.setup.distributed_optimizer else parameters_on_rank
        param, grad, opt = bytes_per_parameter(self.setup.precision, False, 1)
        touched = 2 * (param + grad + opt)  # read and write (roughly) everything Adam touches
        return updated * touched / (self.device.hbm_gbps * 1e9)

    # ---- the simulator's input -------------------------------------------------------------------
    def stage_costs(
        self,
        layout: Sequence[StageInfo],
        *,
        micro_batch: int,
        tensor_parallel: int,
        pipeline: int,
        data_parallel: int,
        recompute: str,
    ) -> Costs:
        """Per global stage ``t_f, t_b, t_w`` (seconds, TP comm included) and the hop time."""
        lt = self.layer_times(micro_batch, tensor_parallel, recompute)
        comm_f, comm_b = self.tp_comm_per_layer(micro_batch, tensor_parallel)
        if recompute == "full":
            comm_b += comm_f
        head = self.head_times(micro_batch, tensor_parallel)
        t_f, t_b, t_w = [], [], []
        for info in layout:
            n = info.layers
            f, b, w = n * (lt.f + comm_f), n * (lt.b + comm_b), n * lt.w
            if info.last:
                f, b, w = f + head.f, b + head.b, w + head.w
            t_f.append(f)
            t_b.append(b)
            t_w.append(w)
        comm = self.p2p_time(micro_batch, tensor_parallel, pipeline, data_parallel)
        return Costs(tuple(t_f), tuple(t_b), tuple(t_w), None, comm)

    def parameters_per_rank(self, layout: Sequence[StageInfo], tensor_parallel: int, num_ranks: int) -> list[float]:
        from .memory import rank_parameters

        return rank_parameters(self.model, tensor_parallel, layout, num_ranks)

    def describe(self) -> str:
        eff = self.efficiency if self.efficiency is not None else self.device.efficiency
        return (
            f"{self.device.name}: {self.device.tflops(self.setup.precision):g} TFLOP/s peak ({self.setup.precision}), "
            f"efficiency {eff:g}, NVLink {self.device.intra_gbps:g} GB/s, network {self.device.inter_gbps:g} GB/s, "
            f"{self.device.gpus_per_node} GPUs/node"
        )
