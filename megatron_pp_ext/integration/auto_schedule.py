"""``--pipeline-schedule auto`` in a training run: megatron's args to the planner's decision.

:func:`megatron_pp_ext.install` calls :func:`resolve` when the flags ask for ``auto`` (the flags themselves
were checked by :func:`~megatron_pp_ext.integration.arguments.validate_arguments`, from their values alone).
It builds the run's planner (:func:`planner_for_run`: megatron's model shape, TP / PP / DP / micro-batch
fixed, every schedule and parameter open), lets :func:`megatron_pp_ext.planner.auto.decide` pick the fastest
that fits, prints the decision table on rank 0, puts the choice into the configuration and checks it against
megatron's flags like a named schedule (:func:`~megatron_pp_ext.integration.arguments.check_schedule_flags`).

With ``--pipeline-replan`` the configuration also carries a re-decision (:class:`Redecision`): after the
profiling iterations of :mod:`megatron_pp_ext.runtime.replan` every rank holds the same measured costs; the
planner decides again with them, among the schedules of the running placement and chunk count (megatron has
built the model chunks), and the run switches if the choice differs.

Dependency direction: this module is integration (it reads megatron's ``args`` and the GPU); the planner it
calls is pure planning over the schedules and the simulator and never imports ``megatron_pp_ext.integration``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ..planner.auto import AutoDecision, decide
from ..planner.memo import SIM_OVERLAP
from ..planner.memory import GIB
from ..planner.result import PlanRow
from ..planner.search import Planner
from ..planner.space import SearchSpace
from ..schedules import registry
from ..schedules.costs import Costs
from ..schedules.layer_split import LayerSplit, split_from_args
from ..schedules.placement import loop_placement, make_placement
from .arguments import _cuda_available, check_schedule_flags
from .config import (
    LayerKindCosts,
    PipelineArgumentError,
    PipelineConfig,
    parse_pipeline_costs,
    parse_pipeline_memory_limit,
)
from .features.layer_placement import virtual_flag_of

__all__ = ["Redecision", "planner_for_run", "resolve", "run_layer_split"]


def _log_rank0(text: str) -> None:
    if int(os.environ.get("RANK", "0")) == 0:
        print(text, flush=True)


def planner_for_run(
    args: Any,
    *,
    budget_gib: float | None,
    stage_costs_ms: tuple[float, float, float] | None,
    cpu: bool,
    overlap: float = SIM_OVERLAP,
    layer_costs: LayerKindCosts | None = None,
) -> Planner:
    """The planner of one training run: megatron's model shape, its TP / PP / DP / micro-batch / recompute
    fixed, every schedule and parameter open. Budget: ``budget_gib`` (all of it; the CPU case) or the
    GPU's memory (2 GiB kept free); the planner counts weights, gradients and optimizer state in a rank's
    peak. Costs: the device's cost model, or ``stage_costs_ms`` (F, B, W of one 1F1B stage, L/p layers,
    for one micro-batch, in ms) spread over the layers; ``layer_costs`` (``--pipeline-costs KIND=F,B,W;...``)
    replace the estimate of the kinds they give (``planner/layer_costs.py``). ``overlap``: see
    ``--pipeline-overlap``. Layers: the run's split (:func:`run_layer_split`), fixed: every candidate is
    simulated and sized with its stages' layers under that split, and one whose placement cannot map it is not
    applicable (the reason in auto's table). A hybrid layer pattern also gives each layer its kind
    (:func:`_layer_kinds`), so each stage costs its layers.
    Long because it maps each megatron argument to the planner's model, device and setup fields in one place.
    """
    from ..planner.cost_model import CostModel, LayerTimes, get_device
    from ..planner.layer_costs import MeasuredLayers
    from ..planner.memory import TrainingSetup
    from ..planner.models import ModelSpec

    groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else None
    model = ModelSpec(
        "run",
        **_layer_kinds(args),
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
        fsdp=(bool(getattr(args, "pipeline_fsdp", False)),),  # the run's own --pipeline-fsdp
        unit_sizes=(unit,) if isinstance(unit := getattr(args, "pipeline_unit_size", None), int) else None,
        given_split=run_layer_split(args),  # megatron builds these layers: auto keeps them
    )
    gbs = int(getattr(args, "global_batch_size", None) or mbs * dp)
    measured = None
    if layer_costs is not None:
        measured = MeasuredLayers.from_ms(dict(layer_costs.entries), layer_costs.micro_batch, layer_costs.tp)
    return Planner(
        model,
        tp * pp * dp,
        gbs,
        cost,
        memory_budget_gib=budget_gib,
        memory_reserve_gib=0.0 if budget_gib is not None else 2.0,
        space=space,
        overlap=overlap,
        measured_layers=measured,
    )


# megatron's hybrid symbols the planner has no cost model of, as the nearest it has: gated delta net as a Mamba
# mixer (a linear-time scan), DeepSeek sparse and multi-latent attention as attention
_NEAREST_KIND = {"G": "M", "D": "*", "+": "*"}


def _layer_kinds(args: Any) -> dict[str, Any]:
    """The run's decoder layers for :class:`~megatron_pp_ext.planner.models.ModelSpec`: ``num_layers``, and
    with ``--hybrid-layer-pattern`` each layer's kind (the pattern without ``|``; MoE layers with megatron's
    expert flags)."""
    pattern = getattr(args, "hybrid_layer_pattern", None)
    if not pattern:
        return {"num_layers": int(args.num_layers)}
    decoder = pattern.split("/")[0].replace("|", "")  # an MTP part ("/") is no decoder layer
    flat = "".join(_NEAREST_KIND.get(c, c) for c in decoder)
    kinds: dict[str, Any] = {"num_layers": len(flat), "hybrid_pattern": flat}
    if "E" in flat:
        kinds["num_experts"] = int(getattr(args, "num_experts", None) or 1)
        kinds["moe_ffn_hidden_size"] = getattr(args, "moe_ffn_hidden_size", None)
        kinds["moe_router_topk"] = int(getattr(args, "moe_router_topk", None) or 2)
        kinds["moe_shared_expert_ffn"] = int(getattr(args, "moe_shared_expert_intermediate_size", None) or 0)
    return kinds


def run_layer_split(args: Any) -> LayerSplit:
    """The layers megatron builds per model stage, which auto keeps: a hybrid layer pattern's ``|`` segments
    (stage ``s`` builds segment ``s`` under every placement, ``runtime/hybrid_pattern.py``; a pattern without
    ``|`` is megatron's even split over the ranks, one chunk each), else megatron's uneven-split flags
    (:data:`~megatron_pp_ext.schedules.layer_split.SPLIT_FLAGS`; even without them). A pattern that splits
    neither way is refused naming ``--hybrid-layer-pattern``."""
    pattern = getattr(args, "hybrid_layer_pattern", None)
    if not pattern:
        return split_from_args(args)
    from ..runtime.hybrid_pattern import HybridPatternError, hybrid_layer_split, pattern_segments

    flag = "--hybrid-layer-pattern"
    p = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    try:
        segments = pattern_segments(pattern, flag)
        if len(segments) > 1:
            return LayerSplit(counts=tuple(len(s) for s in segments))
        return hybrid_layer_split(pattern, loop_placement(p), "--pipeline-schedule auto", flag)
    except HybridPatternError as exc:
        raise PipelineArgumentError(flag, str(exc).removeprefix(f"{flag} ")) from None


def _gpu_device() -> Any:
    import torch

    from ..planner.cost_model import get_device

    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    preset = "H100-80GB" if "H100" in props.name else "A100-80GB"
    return replace(get_device(preset), memory_gib=props.total_memory / GIB)


def _stage_ms(config: PipelineConfig) -> tuple[float, float, float] | None:
    if not isinstance(config.costs, tuple):  # none, or per layer kind (_layer_costs)
        return None
    return float(config.costs[0]), float(config.costs[1]), float(config.costs[2])


def _layer_costs(config: PipelineConfig) -> LayerKindCosts | None:
    return config.costs if isinstance(config.costs, LayerKindCosts) else None


def _apply(config: PipelineConfig, chosen: PlanRow, table: str, costs: Any = None) -> PipelineConfig:
    """``config`` running ``chosen``: its memory limit and chunk count, built with ``costs`` if given, else the
    user's ``--pipeline-costs`` of one stage, else the costs the planner evaluated it with."""
    c = chosen.config
    if costs is None and isinstance(config.costs, tuple):
        costs = config.costs
    if costs is None and c.costs_flag is not None:  # per-layer-kind costs: the stage costs the planner used
        costs = parse_pipeline_costs(c.costs_flag)
    unit_size = config.unit_size
    if c.unit_size is not None and not isinstance(config.unit_size, int):
        unit_size = c.unit_size  # zeropp's U the planner chose (with unit size auto or unset)
    return replace(
        config,
        schedule=c.schedule,
        unit_size=unit_size,
        memory_limit=parse_pipeline_memory_limit(c.memory_limit) if c.memory_limit else None,
        num_virtual_stages=c.v_flag if c.v_flag is not None else config.num_virtual_stages,
        costs=costs,
        auto_table=table,
    )


def resolve(args: Any, config: PipelineConfig) -> PipelineConfig:
    """The configuration running auto's choice for megatron's ``args``; raises PipelineArgumentError."""
    cpu = bool(getattr(args, "cpu", False)) or not _cuda_available()
    overlap = SIM_OVERLAP if config.overlap is None else config.overlap
    planner = planner_for_run(
        args,
        budget_gib=config.memory_budget,
        stage_costs_ms=_stage_ms(config),
        cpu=cpu,
        overlap=overlap,
        layer_costs=_layer_costs(config),
    )
    decision = decide(planner)
    table = decision.table()
    _log_rank0(table)
    if decision.chosen is None:
        budget = planner.budget_bytes / GIB
        raise PipelineArgumentError(  # one line: rank 0 printed the table (what each needs) just above
            "--pipeline-memory-budget", f"no schedule fits in {budget:.3g} GiB per rank (the auto table above)"
        )
    if "|" in (getattr(args, "hybrid_layer_pattern", None) or "") and virtual_flag_of(args) is None:
        # megatron derived its virtual pipeline size from the pattern's segments (segments / p): the chosen
        # schedule's placement sets the chunks, as a virtual flag the user did not give would not
        config = replace(config, num_virtual_stages=None)
    resolved = check_schedule_flags(args, _apply(config, decision.chosen, table))
    if config.replan:
        resolved.redecide = Redecision(args, resolved, cpu=cpu, overlap=overlap, layer_costs=_layer_costs(config))
    return resolved


@dataclass
class Redecision:
    """``--pipeline-replan``: decide again from measured costs, among the running placement's schedules.

    Called (on every rank, with the same agreed costs) by the schedule source of
    :mod:`megatron_pp_ext.runtime.replan`; returns the configuration to run from then on and the decision
    table. ``measured_stage_ms`` (F, B, W of one 1F1B stage of L/p layers, ms) is what the planner used."""

    args: Any
    config: PipelineConfig
    cpu: bool
    overlap: float
    log: Callable[[str], None] = field(default=_log_rank0)
    decision: AutoDecision | None = None
    measured_stage_ms: tuple[float, float, float] | None = None
    layer_costs: LayerKindCosts | None = None  # the user's per-layer-kind costs: still first for their kinds
    result: PipelineConfig | None = None

    def stage_ms_from(self, costs: Costs) -> tuple[float, float, float]:
        """Measured per-stage seconds (embedding and loss included) as ms of one 1F1B stage (L/p layers): the
        sum over one model replica's stages (a bidirectional placement runs two) divided by p."""
        pp = int(getattr(self.args, "pipeline_model_parallel_size", 1) or 1)
        placement = make_placement(
            registry.get(self.config.schedule or "").placement, pp, self.config.num_virtual_stages or 1
        )
        replicas = placement.num_stages // placement.stages_per_replica
        f, b, w, _ = costs.per_stage(placement.num_stages)
        return tuple(sum(x) / replicas / pp * 1e3 for x in (f, b, w))  # type: ignore[return-value]

    def __call__(self, costs: Costs) -> PipelineConfig:
        if self.result is not None:
            return self.result
        running = self.config
        style = registry.get(running.schedule or "").placement
        chunks = running.num_virtual_stages or 1
        names = tuple(n for n in registry.names() if n != "v-block" and registry.get(n).placement == style)
        self.measured_stage_ms = self.stage_ms_from(costs)
        planner = planner_for_run(
            self.args,
            budget_gib=running.memory_budget,
            stage_costs_ms=self.measured_stage_ms,
            cpu=self.cpu,
            overlap=self.overlap,
            layer_costs=self.layer_costs,
        )
        if style == "loop":
            planner.space = replace(planner.space, virtual=(chunks,))
        self.decision = decide(planner, names)
        table = self.decision.table()
        chosen = self.decision.chosen
        before = _label(running)
        f, b, w = self.measured_stage_ms
        head = (
            f"megatron_pp_ext: auto re-decided from the measured profile (one 1F1B stage: F {f:.4g} ms, "
            f"B {b:.4g} ms, W {w:.4g} ms), among {style} schedules with {chunks} chunk(s) per rank: "
        )
        if chosen is None:  # nothing of this placement fits under the measured costs: keep running
            self.result = running
            self.log(head + f"none fits, keeping {before}\n{table}")
            return running
        new = _apply(running, chosen, table, costs)  # a cost-aware choice is built with the measured profile
        self.result = new
        after = _label(new)
        self.log(head + (f"switching {before} -> {after}" if after != before else f"keeping {before}") + f"\n{table}")
        return new


def _label(config: PipelineConfig) -> str:
    return f"{config.schedule}" + (f"@{config.memory_limit}" if config.memory_limit is not None else "")
