"""The Megatron flags of a planned configuration (``scripts/pretrain_gpt.py``'s command line)."""

from __future__ import annotations

from .layer_layouts import layout_args
from .memory import TrainingSetup
from .models import ModelSpec
from .space import Config


def config_args(config: Config, setup: TrainingSetup, global_batch: int, model: ModelSpec | None = None) -> list[str]:
    """The parallelism / schedule / memory flags of ``scripts/pretrain_gpt.py`` for ``config``. A hybrid
    ``model`` gets its layer split as ``--hybrid-layer-pattern`` with ``|`` between the stages, always (the
    even split too), and none of the flags megatron refuses beside it (virtual pipeline size, layout,
    first/last, account-for): the segments give megatron the chunks per rank."""
    hybrid = model.hybrid_pattern if model is not None else None
    args = [
        "--tensor-model-parallel-size",
        str(config.tp),
        "--pipeline-model-parallel-size",
        str(config.pp),
        "--micro-batch-size",
        str(config.micro_batch),
        "--global-batch-size",
        str(global_batch),
        "--pipeline-schedule",
        config.schedule,
    ]
    planned_loop = config.layout is not None and config.placement == "loop"
    # a layout (or a hybrid pattern's segments) gives megatron the chunks
    if config.v_flag is not None and config.chunks > 1 and not planned_loop and hybrid is None:
        args += ["--num-virtual-stages-per-pipeline-rank", str(config.chunks)]
    if config.memory_limit:
        args += ["--pipeline-memory-limit", config.memory_limit]
    if config.costs_flag:
        args += ["--pipeline-costs", config.costs_flag]
    if config.unit_size is not None:
        args += ["--pipeline-unit-size", str(config.unit_size)]
    if config.fsdp:
        args.append("--pipeline-fsdp")
    if hybrid is not None:
        args += layout_args(config.placement, config.split, hybrid)
    elif config.uneven:
        args += ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
    if config.layout is not None and hybrid is None:
        args += layout_args(config.placement, config.split)
    if setup.uses_sp(config.tp):
        args.append("--sequence-parallel")
    if setup.distributed_optimizer and not config.fsdp:  # FSDP shards the optimizer state itself
        args.append("--use-distributed-optimizer")
    if config.recompute == "selective":
        args += ["--recompute-granularity", "selective"]
    elif config.recompute == "full":
        args += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    return args


def precision_args(setup: TrainingSetup) -> list[str]:
    return {"bf16": ["--bf16"], "fp16": ["--fp16"], "fp32": []}[setup.precision]


def model_args(model: ModelSpec) -> list[str]:
    """Model shape flags plus the mock-data tokenizer that gives the model's vocabulary."""
    return [*model.megatron_args(), "--tokenizer-type", "NullTokenizer", "--vocab-size", str(model.vocab_size)]
