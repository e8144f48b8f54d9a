"""``auto``: pick the fastest schedule that fits the memory budget.

The same logic behind ``megatron-pp plan --schedules auto`` and ``--pipeline-schedule auto``: the
:class:`~.plan.Planner` evaluates every registered schedule with every parameter it takes (chunks per
rank for loop placements, the memory limits :data:`AUTO_MEMORY_LIMITS` for memory-aware schedules, the
costs for cost-aware ones) with the simulator and the memory model, drops what does not fit the budget
and ranks the rest by estimated iteration time; ``auto`` takes the first. :class:`AutoDecision` prints
the decision table: the top candidates with their time, bubble and memory, and why the others were
dropped (over the budget, with the least memory any of their configurations needs, or not applicable,
with the generator's reason).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .memory import GIB
from .plan import Planner, PlanResult, PlanRow, SearchSpace, format_table

__all__ = ["AUTO", "AUTO_MEMORY_LIMITS", "AutoDecision", "auto_space", "decide"]

AUTO = "auto"
AUTO_MEMORY_LIMITS = ("p", "2p")  # memory limits tried for memory-aware schedules (besides their default)


def auto_space(space: SearchSpace) -> SearchSpace:
    """``space`` with every registered schedule and the auto memory limits added to its own."""
    limits = tuple(dict.fromkeys((*space.memory_limits, *AUTO_MEMORY_LIMITS)))
    return replace(space, schedules=None, memory_limits=limits)


@dataclass
class AutoDecision:
    result: PlanResult
    overlap: float = 0.0  # the planner's overlap factor of forward-and-backward pairs

    @property
    def chosen(self) -> PlanRow | None:
        return self.result.rows[0] if self.result.rows else None

    def table(self, top: int = 5) -> str:
        """The decision table (printed on rank 0)."""
        result, chosen = self.result, self.chosen
        budget = result.budget_bytes / GIB
        if chosen is None:
            lines = [f"pipeline schedule auto: nothing fits in {budget:.2f} GiB"]
        else:
            c = chosen.config
            lines = [
                f"pipeline schedule auto: {_label(chosen)} (v={c.chunks}, {c.placement} placement): iteration "
                f"{chosen.iteration_time * 1e3:.3g} ms, bubble {chosen.sync_bubble_rate:.3f}, peak "
                f"{chosen.peak_memory / GIB:.2f} of {budget:.2f} GiB; {result.evaluated} candidates simulated"
                + (f"; overlap pairs timed with overlap F={self.overlap:g}" if self.overlap else "")
            ]
        header = ["#", "schedule", "v", "iteration ms", "pipeline ms", "bubble", "sync bubble", "peak GiB"]
        rows = [
            [
                str(i),
                _label(row),
                str(row.config.chunks),
                f"{row.iteration_time * 1e3:.4g}",
                f"{row.pipeline_time * 1e3:.4g}",
                f"{row.bubble_rate:.4f}",
                f"{row.sync_bubble_rate:.4f}",
                f"{row.peak_memory / GIB:.3f}",
            ]
            for i, row in enumerate(_best_per_schedule(result.rows)[:top], 1)
        ]
        if rows:
            lines.append(format_table(header, rows))
        fitting = {_label(row) for row in result.rows}
        for label, peak in sorted(result.over_budget_best.items()):
            if label not in fitting:
                lines.append(f"  dropped {label}: over budget (needs {peak / GIB:.3f} GiB > {budget:.3f})")
        for name, reasons in sorted(result.inapplicable.items()):
            if not any(label.split("@")[0] == name for label in fitting):
                why, _ = reasons.most_common(1)[0]
                lines.append(f"  dropped {name}: not applicable: {why}")
        return "\n".join(lines)


def _label(row: PlanRow) -> str:
    c = row.config
    return c.schedule + (f"@{c.memory_limit}" if c.memory_limit else "")


def _best_per_schedule(rows: list[PlanRow]) -> list[PlanRow]:
    seen: dict[str, PlanRow] = {}
    for row in rows:
        seen.setdefault(_label(row), row)
    return list(seen.values())


def decide(planner: Planner) -> AutoDecision:
    """Run ``planner`` over every schedule (see :func:`auto_space`) and keep its ranking."""
    planner.space = auto_space(planner.space)
    planner.schedule_names = tuple(sorted(_registered()))
    return AutoDecision(planner.run(progress=False), planner.overlap)


def _registered() -> list[str]:
    from ..schedules import registry

    return [registry.get(name).name for name in registry.names()]


# ---- --pipeline-schedule auto (megatron's args) ------------------------------------------------------
def planner_for_run(
    args: Any, *, budget_gib: float | None, stage_costs_ms: tuple[float, float, float] | None, cpu: bool
) -> Planner:
    """The planner of one training run: megatron's model shape, its TP / PP / DP / micro-batch / recompute
    fixed, every schedule and parameter open. Budget: ``budget_gib`` (all of it; the CPU case) or the
    GPU's memory (2 GiB kept free); the planner counts weights, gradients and optimizer state in a rank's
    peak. Costs: the device's cost model, or ``stage_costs_ms`` (F, B, W of one 1F1B stage, L/p layers,
    for one micro-batch, in ms) spread over the layers."""
    from .costs import CostModel, LayerTimes, get_device
    from .memory import TrainingSetup
    from .models import ModelSpec

    groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else None
    model = ModelSpec(
        "run",
        num_layers=int(args.num_layers),
        hidden_size=int(args.hidden_size),
        num_attention_heads=int(args.num_attention_heads),
        seq_length=int(args.seq_length),
        vocab_size=int(getattr(args, "vocab_size", None) or getattr(args, "padded_vocab_size", None) or 50257),
        ffn_hidden_size=getattr(args, "ffn_hidden_size", None),
        num_query_groups=groups,
        swiglu=bool(getattr(args, "swiglu", False)),
        untie_embeddings_and_output_weights=bool(getattr(args, "untie_embeddings_and_output_weights", False)),
        hidden_dropout=float(getattr(args, "hidden_dropout", 0.1) or 0.0),
        attention_dropout=float(getattr(args, "attention_dropout", 0.1) or 0.0),
    )
    device = get_device("CPU") if cpu else _gpu_device()
    precision = "bf16" if getattr(args, "bf16", False) else "fp16" if getattr(args, "fp16", False) else "fp32"
    setup = TrainingSetup(
        precision=precision,
        distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)),
        sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
        attention="unfused" if cpu or getattr(args, "transformer_impl", "local") == "local" else "flash",
    )
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    pp = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    dp = int(getattr(args, "data_parallel_size", 1) or 1)
    mbs = int(args.micro_batch_size)
    cost = CostModel(model, device, setup)
    if stage_costs_ms is not None:
        per_layer = [x * 1e-3 / max(1.0, model.num_layers / pp) for x in stage_costs_ms]
        cost = cost.with_measured_layer_times(LayerTimes(*per_layer), mbs, tp)
    granularity = getattr(args, "recompute_granularity", None)
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    space = SearchSpace(
        tp=(tp,),
        pp=(pp,),
        micro_batch=(mbs,),
        recompute=(granularity or "none",),
        virtual=(int(vp),) if vp else (1, 2, 3, 4),
    )
    gbs = int(getattr(args, "global_batch_size", None) or mbs * dp)
    return Planner(
        model,
        tp * pp * dp,
        gbs,
        cost,
        memory_budget_gib=budget_gib,
        memory_reserve_gib=0.0 if budget_gib is not None else 2.0,
        space=space,
    )


def _gpu_device() -> Any:
    import torch

    from .costs import get_device

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    preset = "H100-80GB" if "H100" in props.name else "A100-80GB"
    return replace(get_device(preset), memory_gib=props.total_memory / GIB)
