"""MoE planning: expert parallelism as a search axis, an all-to-all cost model, and each schedule with and
without the overlap of its F&B pairs (``megatron-pp plan --moe-report``).

All-to-all cost (one dispatch or one combine of one MoE layer for one micro-batch, per rank)::

    tokens = s * b / TP   (sequence parallel; s * b without TP)
    V      = tokens * topk * hidden * bytes_per_element            bytes one rank sends
    n      = ranks of the EP group on one node = min(EP, gpus_per_node // TP)   (megatron's rank order
             puts TP innermost, then EP: the group spans EP * TP consecutive ranks)
    time   = latency + max(V * (n - 1) / EP / intra_bw,  V * (EP - n) / EP / inter_bw)

The ``EP - 1`` destinations other than the rank itself get ``V / EP`` each (uniform routing); those on
the same node go over NVLink (``intra_gbps`` of the device preset), the others over the network
(``inter_gbps``); both links run at once, the slower sets the time; ``latency``: the network's when the
group leaves the node, else NVLink's. EP = 1: no all-to-all.

Expert parallelism (megatron's rule with expert tensor parallelism = TP): EP divides the data-parallel
size and the number of routed experts. An EP size is kept when the rank's parameter, gradient and
optimizer bytes fit the memory budget (non-expert weights replicated over DP, the routed experts split
over EP and their optimizer state over DP / EP with the distributed optimizer); activations are not
counted here (the main search does that).

Per schedule and EP size the pipeline is simulated (:func:`~megatron_pp_ext.analysis.simulate.simulate`
with :class:`~megatron_pp_ext.analysis.moe_comm.MoeComm`) with each MoE layer's all-to-alls added to
its ops (no overlap) and, where the schedule carries overlap pairs, with those pairs on two streams
(overlap). ``mark_pairs`` turns a generated schedule into the order and pairs the executor overlaps
(default: :func:`~megatron_pp_ext.analysis.overlap_order.overlap_order`, which the executor applies: the
warm-up deepened where pairs need it; dualpipev keeps its own); the time without overlap is the generated
schedule's. The times are the pipeline's
makespan (no data-parallel reduction, no optimizer step). Pure Python.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..analysis.moe_comm import MoeComm
from ..analysis.overlap_order import overlap_order
from ..analysis.simulate import simulate
from ..schedules import registry
from ..schedules.costs import Costs
from ..schedules.ir import ScheduleError
from ..schedules.placement import loop_placement
from ..schedules.schedule import Schedule
from .cost_model import CostModel
from .layer_costs import kind_layout, layer_cost_table, stage_costs
from .memory import bytes_per_parameter, split_layers, stage_layout, stage_parameters
from .models import ModelSpec

__all__ = ["MoeRow", "MoeShape", "a2a_seconds", "ep_sizes", "moe_report_text", "moe_rows"]


@dataclass(frozen=True)
class MoeShape:
    """Where the MoE comparison runs: GPUs, pipeline and tensor parallel sizes, micro-batch, global batch."""

    gpus: int
    pp: int
    tp: int
    micro_batch: int
    global_batch: int

    @property
    def dp(self) -> int:
        return self.gpus // (self.pp * self.tp)

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)

    def check(self) -> None:
        """ValueError naming the flag when the shape does not divide."""
        if self.gpus % (self.pp * self.tp):
            raise ValueError(f"--gpus {self.gpus} is not a multiple of --pp x --tp = {self.pp * self.tp}")
        if self.global_batch % (self.dp * self.micro_batch) or self.num_microbatches < 1:
            raise ValueError(
                f"--global-batch {self.global_batch} is not a positive multiple of DP x micro-batch = "
                f"{self.dp} x {self.micro_batch}"
            )


def a2a_seconds(model: ModelSpec, cost: CostModel, micro_batch: int, tp: int, ep: int) -> float:
    """One all-to-all of one MoE layer for one micro-batch (module doc)."""
    if ep <= 1:
        return 0.0
    device, setup = cost.device, cost.setup
    tokens = model.seq_length * micro_batch / (tp if setup.uses_sp(tp) else 1)
    volume = tokens * model.moe_router_topk * model.hidden_size * setup.activation_bytes
    per_node = max(1, min(ep, device.gpus_per_node // max(1, tp)))
    intra = volume * (per_node - 1) / ep / (device.intra_gbps * 1e9)
    inter = volume * (ep - per_node) / ep / (device.inter_gbps * 1e9)
    latency = device.inter_latency_us if ep > per_node else device.intra_latency_us
    return latency * 1e-6 + max(intra, inter)


def ep_sizes(dp: int, num_experts: int) -> list[int]:
    """Expert-parallel sizes megatron accepts here: divisors of the data-parallel size that divide the
    routed experts."""
    return [e for e in range(1, dp + 1) if dp % e == 0 and num_experts % e == 0]


def _routed_parameters(model: ModelSpec, tp: int) -> float:
    """Parameters of one MoE layer's routed experts on one TP rank (no biases)."""
    up = 2 if model.swiglu else 1
    width = model.expert_ffn
    return (model.num_experts or 0) * (model.hidden_size * up * width + width * model.hidden_size) / tp


def static_bytes(model: ModelSpec, cost: CostModel, shape: MoeShape, split: Sequence[int], ep: int) -> float:
    """Largest parameter + gradient + optimizer bytes of a rank at EP = ``ep`` (one chunk per rank)."""
    layout = kind_layout(model, cost.setup, loop_placement(shape.pp), split, shape.tp, shape.micro_batch, "none")
    params = stage_parameters(model, shape.tp, layout)
    kinds = model.layer_kinds()
    setup = cost.setup
    dense = sum(bytes_per_parameter(setup.precision, setup.distributed_optimizer, shape.dp))
    expert = sum(bytes_per_parameter(setup.precision, setup.distributed_optimizer, max(1, shape.dp // ep)))
    routed = _routed_parameters(model, shape.tp)
    worst = 0.0
    for info, total in zip(layout, params, strict=True):
        moe = sum(1 for k in kinds[info.offset : info.offset + info.layers] if k == "moe")
        experts = moe * routed
        worst = max(worst, (total - experts) * dense + experts / ep * expert)
    return worst


def layer_split(num_layers: int, slices: int) -> tuple[int, ...]:
    """Layers per model slice: megatron's even or embedding-and-loss split when one divides, else the
    remainder spread one layer each over the slices after the first."""
    split = split_layers(num_layers, slices, "auto")
    if split is not None:
        return split
    base, extra = divmod(num_layers, slices)
    if base < 1:
        raise ValueError(f"{num_layers} layers cannot fill {slices} pipeline stages")
    return tuple(base + (1 if 0 < i <= extra else 0) for i in range(slices))


@dataclass(frozen=True)
class MoeRow:
    """One schedule at one EP size: simulated pipeline times (s) without and with overlap (None: no pairs)."""

    schedule: str
    v: int
    ep: int
    a2a_s: float
    without: float
    with_overlap: float | None
    pairs: int

    @property
    def best(self) -> float:
        return self.without if self.with_overlap is None else min(self.without, self.with_overlap)

    @property
    def overlap_gain(self) -> float | None:
        """``without / with``: > 1 when the overlap makes the iteration faster."""
        return None if self.with_overlap is None else self.without / self.with_overlap


def _built(
    name: str, model: ModelSpec, cost: CostModel, shape: MoeShape
) -> tuple[Schedule, Costs, tuple[int, ...]] | str:
    """The schedule at the shape with its per-stage compute costs and MoE layers per stage, or why not."""
    from ..schedule_args import generate_schedule

    p, m = shape.pp, shape.num_microbatches
    try:
        probe = generate_schedule(name, p, m)
        placement = probe.placement
        split = layer_split(model.num_layers, placement.stages_per_replica)
        layout = stage_layout(placement, split)
        table = layer_cost_table(cost, shape.micro_batch, shape.tp, "none")
        comm = cost.p2p_time(shape.micro_batch, shape.tp, p, shape.dp)
        costs = stage_costs(table, layout, placement, comm)
        schedule = (
            generate_schedule(name, p, m, probe.chunks_per_rank, costs) if registry.get(name).takes("costs") else probe
        )
    except (ScheduleError, ValueError) as exc:
        return str(exc).splitlines()[0]
    kinds = model.layer_kinds()
    layers = tuple(sum(1 for k in kinds[i.offset : i.offset + i.layers] if k == "moe") for i in layout)
    return schedule, costs, layers


def moe_rows(
    model: ModelSpec,
    cost: CostModel,
    shape: MoeShape,
    schedules: Sequence[str],
    eps: Sequence[int] | None = None,
    budget_bytes: float | None = None,
    mark_pairs: Callable[[Schedule], Schedule] = overlap_order,
) -> tuple[list[MoeRow], dict[str, str], dict[int, str]]:
    """Every schedule at every EP size that divides and fits; with the schedules that did not build (why)
    and the EP sizes dropped (why)."""
    if not model.num_experts:
        raise ValueError(f"model {model.name} has no experts: --moe-report needs a MoE model")
    shape.check()
    valid = ep_sizes(shape.dp, model.num_experts)
    wanted = list(valid if eps is None else eps)
    dropped: dict[int, str] = {}
    split = layer_split(model.num_layers, shape.pp)
    kept = []
    for ep in wanted:
        if ep not in valid:
            dropped[ep] = f"EP must divide DP = {shape.dp} and the {model.num_experts} routed experts"
            continue
        need = static_bytes(model, cost, shape, split, ep)
        if budget_bytes is not None and need > budget_bytes:
            dropped[ep] = f"parameters and optimizer state need {need / 2**30:.1f} GiB per rank"
            continue
        kept.append(ep)
    rows: list[MoeRow] = []
    skipped: dict[str, str] = {}
    for name in schedules:
        built = _built(name, model, cost, shape)
        if isinstance(built, str):
            skipped[name] = built
            continue
        schedule, costs, layers = built
        marked = mark_pairs(schedule)
        pairs = sum(len(row) for row in marked.overlap_pairs)
        for ep in kept:
            a2a = a2a_seconds(model, cost, shape.micro_batch, shape.tp, ep)
            off = simulate(schedule, costs, moe=MoeComm(a2a, layers)).makespan
            on = simulate(marked, costs, moe=MoeComm(a2a, layers, overlap=True)).makespan if pairs else None
            rows.append(MoeRow(name, schedule.chunks_per_rank, ep, a2a, off, on, pairs))
    return rows, skipped, dropped


def moe_report_text(
    model: ModelSpec, shape: MoeShape, rows: Sequence[MoeRow], skipped: dict[str, str], dropped: dict[int, str]
) -> str:
    """The comparison table and which schedule wins, with and without overlap, and by how much."""
    head = (
        f"{model.name}: {shape.gpus} GPUs, PP {shape.pp} x TP {shape.tp} x DP {shape.dp}, micro-batch "
        f"{shape.micro_batch}, {shape.num_microbatches} micro-batches; pipeline makespan per iteration (simulated)"
    )
    lines = [head, "", f"{'schedule':<16} {'v':>2} {'EP':>4} {'a2a ms':>8} {'no overlap s':>13} {'overlap s':>10} gain"]
    for r in sorted(rows, key=lambda r: (r.best, r.schedule, r.ep)):
        on = "-" if r.with_overlap is None else f"{r.with_overlap:.3f}"
        gain = "no pairs" if r.overlap_gain is None else f"{(r.overlap_gain - 1) * 100:+.1f}%"
        lines.append(f"{r.schedule:<16} {r.v:>2} {r.ep:>4} {r.a2a_s * 1e3:>8.3f} {r.without:>13.3f} {on:>10} {gain}")
    for ep, why in sorted(dropped.items()):
        lines.append(f"EP {ep} dropped: {why}")
    for name, why in sorted(skipped.items()):
        lines.append(f"{name}: not applicable: {why}")
    if rows:
        lines += ["", *_verdict(rows)]
    return "\n".join(lines)


def _verdict(rows: Sequence[MoeRow]) -> list[str]:
    out = []
    for ep in sorted({r.ep for r in rows}):
        mine = [r for r in rows if r.ep == ep]
        off = min(mine, key=lambda r: r.without)
        line = f"EP {ep}: best without overlap {off.schedule} {off.without:.3f} s"
        on_rows = [r for r in mine if r.with_overlap is not None]
        if on_rows:
            on = min(on_rows, key=lambda r: r.with_overlap or 0.0)
            assert on.with_overlap is not None
            how = _faster(off.without, on.with_overlap)
            line += f"; best with overlap {on.schedule} {on.with_overlap:.3f} s ({how})"
        out.append(line)
    best_off = min(rows, key=lambda r: r.without)
    overlapped = [r for r in rows if r.with_overlap is not None]
    out.append(f"best without overlap: {best_off.schedule} at EP {best_off.ep}, {best_off.without:.3f} s")
    if not overlapped:
        out.append("no schedule here carries overlap pairs: overlap changes nothing")
        return out
    best_on = min(overlapped, key=lambda r: r.with_overlap or 0.0)
    assert best_on.with_overlap is not None
    out.append(
        f"best with overlap: {best_on.schedule} at EP {best_on.ep}, {best_on.with_overlap:.3f} s "
        f"({(best_on.without / best_on.with_overlap - 1) * 100:+.1f}% over the same schedule without overlap)"
    )
    winner = "with overlap" if best_on.with_overlap < best_off.without else "without overlap"
    ratio = max(best_off.without, best_on.with_overlap) / min(best_off.without, best_on.with_overlap)
    name = best_on.schedule if winner == "with overlap" else best_off.schedule
    out.append(f"winner: {name} {winner}, {(ratio - 1) * 100:.1f}% faster than the best {_other(winner)}")
    return out


def _faster(without: float, with_overlap: float) -> str:
    """How the overlapped time compares, in words."""
    if with_overlap < without:
        return f"overlap {(without / with_overlap - 1) * 100:.1f}% faster"
    return f"overlap {(with_overlap / without - 1) * 100:.1f}% slower"


def _other(winner: str) -> str:
    return "without overlap" if winner == "with overlap" else "with overlap"
