"""The planner's flags: model, cluster and search space (``megatron-pp plan``, ``grid`` and ``launch-local``,
and the plan specifications under ``scripts/slurm/specs``, which are written in them), and the
:class:`~.search.Planner` they describe."""

from __future__ import annotations

import argparse
from dataclasses import replace

from ..argtypes import (
    fraction,
    int_in,
    layer_costs,
    layout,
    memory_limit_list,
    nonnegative_float,
    positive_float,
    positive_fraction,
    positive_int,
)
from .cost_model import CostModel
from .layer_costs import MeasuredLayers
from .layer_layouts import check_layout
from .memo import SIM_OVERLAP, PlannerMemo
from .memory import TrainingSetup, w_memory_fraction
from .schedule_cache import default_cache_dir
from .search import Planner
from .space import SearchSpace

__all__ = ["GLOBAL_BATCH", "GPUS", "add_plan_arguments", "planner_from_args"]

# Upper bounds of the cluster flags, far beyond real runs, so that a typo is one line instead of a search
# that never ends (the shapes come from the divisors of both numbers, the micro-batch counts from the batch).
GPUS = int_in(1, 1 << 20, "the largest clusters have ~10^5 GPUs")


GLOBAL_BATCH = int_in(1, 1 << 20, "published global batches are at most a few thousand sequences")


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def positive_int_list(text: str) -> tuple[int, ...]:
    """Comma-separated integers >= 1, as the search-space flags take them (an argparse type)."""
    return _int_list(text)


def _str_list(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in str(text).split(",") if x.strip())


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """The model / cluster / search flags shared by ``plan``, ``grid`` and ``launch-local``.
    Long because it lists the flags, one ``add_argument`` each, in the order ``--help`` shows them.
    """
    g = parser.add_argument_group("model (a preset, or explicit shapes; explicit flags override a preset)")
    g.add_argument("--model", help="model preset (see --list-models)")
    g.add_argument("--list-models", action="store_true", help="print the model presets and exit")
    g.add_argument("--num-layers", type=positive_int)
    g.add_argument("--hidden-size", type=positive_int)
    g.add_argument("--num-attention-heads", type=positive_int)
    g.add_argument("--seq-length", type=positive_int)
    g.add_argument("--vocab-size", type=positive_int)
    g.add_argument("--ffn-hidden-size", type=positive_int)
    g.add_argument("--num-query-groups", type=positive_int, help="grouped-query attention groups")
    g.add_argument("--swiglu", action="store_true", default=None)
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None)
    c = parser.add_argument_group("cluster and training")
    c.add_argument("--gpus", type=GPUS, help="number of GPUs (default: the preset's)")
    c.add_argument("--global-batch", type=GLOBAL_BATCH, help="global batch size in sequences (default: the preset's)")
    c.add_argument("--device", default="A100-80GB", help="device preset: A100-80GB, H100-80GB, H200, V100-32GB, CPU")
    c.add_argument("--gpus-per-node", type=positive_int, help="GPUs per node (default: the device preset's, 8)")
    c.add_argument("--memory-budget", type=positive_float, help="GiB per GPU (default: the device's memory)")
    c.add_argument(
        "--memory-reserve", type=nonnegative_float, default=2.0, help="GiB kept free (CUDA context, NCCL, ...)"
    )
    c.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default=None, help="default bf16 (fp32 on CPU)")
    c.add_argument("--distributed-optimizer", action="store_true", help="Megatron's --use-distributed-optimizer")
    c.add_argument("--no-sequence-parallel", action="store_true", help="do not use sequence parallelism with TP")
    c.add_argument("--attention", choices=("flash", "unfused"), default=None, help="default flash (unfused on CPU)")
    c.add_argument(
        "--efficiency", type=positive_fraction, help="share of peak FLOP/s large GEMMs reach (default: device's)"
    )
    c.add_argument("--dp-overlap", type=fraction, default=0.0, help="share of the DP gradient reduction hidden")
    c.add_argument(
        "--overlap",
        type=fraction,
        default=SIM_OVERLAP,
        metavar="F",
        help="overlap factor of forward-and-backward pairs (dualpipev), as in simulate: a pair takes "
        "max + (1-F) x min; default %(default)g = one after the other",
    )
    c.add_argument(
        "--w-retained", type=fraction, default=1.0, help="share of an activation a B keeps until its W (1.0 = papers')"
    )
    c.add_argument(
        "--post-validation",
        action="store_true",
        help="optimizer post-validation (no synchronisation before the step): an iteration takes the simulated "
        "back-to-back time per iteration, and zb-auto minimises it (--objective span)",
    )
    c.add_argument(
        "--w-memory",
        type=_w_memory_arg,
        default=None,
        metavar="auto|FRACTION",
        help="share of an activation a pending W keeps, in (0, 1]; 'auto' derives it from the model shape, "
        "attention and recompute setting (zero-bubble paper Table 1: M_W/M_B); sets --w-retained and "
        "zb-auto's memory accounting (default: --w-retained, zb-auto counting whole activations)",
    )
    s = parser.add_argument_group("search space (comma-separated lists; default: everything valid)")
    s.add_argument(
        "--schedules",
        type=_str_list,
        help="schedules to consider (default: every registered one); 'auto': every one with the memory limits "
        "p and 2p too, and print the auto decision table (what --pipeline-schedule auto picks)",
    )
    s.add_argument("--tp", type=_int_list)
    s.add_argument("--pp", type=_int_list)
    s.add_argument("--micro-batch", type=_int_list, help="default 1,2,4,8,16 (and the preset's)")
    s.add_argument("--virtual", type=_int_list, default=(1, 2, 3, 4), help="chunks per rank for loop placements")
    s.add_argument("--recompute", type=_str_list, default=("none", "selective", "full"))
    s.add_argument("--schedule-memory-limits", type=memory_limit_list, default=(), help="also try these (e.g. p,2p)")
    s.add_argument(
        "--fsdp",
        choices=("off", "on", "both"),
        default=None,
        help="FSDP inside the pipeline (--pipeline-fsdp) per candidate, for schedules that declare it (TP=1, untied "
        "embeddings, DP >= 2): off (default; 'both' with --schedules auto), on (only sharded rows where allowed), both",
    )
    s.add_argument("--unit-sizes", type=_int_list, help="zeropp unit sizes U to try (default: every divisor of m)")
    s.add_argument(
        "--layer-split",
        choices=("auto", "even", "embedding-loss", "search"),
        default="auto",
        help="layers per stage: even, embedding-loss (first and last stage one layer short), auto (even if "
        "possible, else embedding-loss), search (plan each candidate's layout too, with per-layer costs: "
        "docs/planner.md); default %(default)s",
    )
    s.add_argument(
        "--layout",
        type=layout,
        help="evaluate this layer layout only (megatron's --pipeline-model-parallel-layout text, e.g. "
        "'Et*3|t*4|t*4|t*3L'); the candidates whose stages it fits",
    )
    s.add_argument(
        "--layer-costs",
        type=layer_costs,
        help="measured per-layer times, ms for one micro-batch: 'dense=F,B,W;head=F,B,W;embedding=F,B,W"
        "[;micro_batch=N;tp=N]' (kinds: dense, moe, mamba, attention, mlp, moe-mlp, embedding, head)",
    )
    s.add_argument(
        "--cache",
        default=str(default_cache_dir()),
        help="directory caching slow schedule generators' output across runs (default %(default)s)",
    )
    s.add_argument("--no-cache", action="store_true", help="do not read or write the schedule cache")


_FSDP_CHOICES = {"off": (False,), "on": (True,), "both": (False, True)}


def planner_from_args(args: argparse.Namespace, memo: PlannerMemo | None = None) -> Planner:
    """The planner the flags describe: model, device, training setup, budget and search.

    Long because it maps each flag to its field of the model, device and setup in one place.
    """
    from .cost_model import get_device
    from .models import ModelSpec, get_model

    shapes = {
        "num_layers": args.num_layers,
        "hidden_size": args.hidden_size,
        "num_attention_heads": args.num_attention_heads,
        "seq_length": args.seq_length,
        "vocab_size": args.vocab_size,
        "ffn_hidden_size": args.ffn_hidden_size,
        "num_query_groups": args.num_query_groups,
        "swiglu": args.swiglu,
        "untie_embeddings_and_output_weights": args.untie_embeddings_and_output_weights,
    }
    if args.model:
        model = get_model(args.model)
        if any(v is not None for v in shapes.values()):
            model = model.with_overrides(name=f"{model.name}-custom", assumed=(), **shapes)
    else:
        missing = [
            f"--{k.replace('_', '-')}"
            for k in ("num_layers", "hidden_size", "num_attention_heads", "seq_length")
            if shapes[k] is None
        ]
        if missing:
            raise ValueError(f"give --model PRESET or the model shape ({', '.join(missing)} missing)")
        model = ModelSpec("custom", **{k: v for k, v in shapes.items() if v is not None})
    device = get_device(args.device)
    if args.gpus_per_node:
        device = replace(device, gpus_per_node=args.gpus_per_node)
    cpu = device.name == "CPU"
    setup = TrainingSetup(
        precision=args.precision or ("fp32" if cpu else "bf16"),
        distributed_optimizer=args.distributed_optimizer,
        sequence_parallel=not args.no_sequence_parallel,
        attention=args.attention or ("unfused" if cpu else "flash"),
        w_retained_fraction=args.w_retained,
    )
    w_memory = getattr(args, "w_memory", None)
    if w_memory == "auto":  # one share per plan: the smallest TP searched, the first recompute setting
        w_memory = w_memory_fraction(model, min(args.tp or (1,)), setup, (args.recompute or ("none",))[0])
    if w_memory is not None:
        setup = replace(setup, w_retained_fraction=float(w_memory))
    cost_model = CostModel(model, device, setup, efficiency=args.efficiency, dp_overlap=args.dp_overlap)
    gpus = args.gpus or model.default_gpus
    batch = args.global_batch or model.default_global_batch
    if not gpus or not batch:
        raise ValueError(f"model {model.name} has no default GPU count / global batch: give --gpus and --global-batch")
    for r in args.recompute:
        if r not in ("none", "selective", "full"):
            raise ValueError(f"--recompute values must be none, selective or full, got {r!r}")
    auto = tuple(args.schedules or ()) == ("auto",)
    space = SearchSpace(
        tp=args.tp,
        pp=args.pp,
        micro_batch=args.micro_batch,
        virtual=tuple(args.virtual),
        recompute=tuple(args.recompute),
        schedules=None if auto else args.schedules,
        memory_limits=tuple(args.schedule_memory_limits),
        layer_split="search" if getattr(args, "layout", None) else args.layer_split,
        layout=getattr(args, "layout", None),
        fsdp=_FSDP_CHOICES[args.fsdp] if getattr(args, "fsdp", None) else None,
        unit_sizes=getattr(args, "unit_sizes", None),
    )
    if space.layout is not None:
        check_layout(space.layout, model.num_layers)
    measured = getattr(args, "layer_costs", None)
    if auto:  # every schedule and parameter (planner/auto.py)
        from .auto import auto_space

        space = auto_space(space)
    return Planner(
        model,
        gpus,
        batch,
        cost_model,
        memory_budget_gib=args.memory_budget,
        memory_reserve_gib=args.memory_reserve,
        space=space,
        cache_dir=None if args.no_cache else args.cache,
        w_memory=None if w_memory is None else float(w_memory),
        post_validation=bool(getattr(args, "post_validation", False)),
        memo=memo,
        overlap=args.overlap,
        measured_layers=MeasuredLayers.from_ms(*measured) if measured else None,
    )


def _w_memory_arg(text: str) -> str | float:
    """``--w-memory``: ``auto`` or a share in (0, 1]."""
    if text.strip().lower() == "auto":
        return "auto"
    return positive_fraction(text)
