"""Checks of the plugin's megatron flags against megatron's own, before any process group exists.

The flags themselves (names, values, help, defaults) are declared once, on
:class:`~.config.PipelineConfig`; :mod:`.flags` generates the argparse group from them and
``docs/flags.md`` lists them. ``add_arguments(parser)`` is an ``extra_args_provider`` for megatron's
``parse_and_validate_args``; :func:`validate_arguments` runs after it (megatron's own checks have run
and ``args.data_parallel_size`` is known): it resolves the :class:`PipelineConfig`, refuses flags the
selected schedule cannot honour (one ``argument --flag: ...`` line), and sets megatron's chunk count
from the schedule's placement (``args.virtual_pipeline_model_parallel_size``), as a megatron user
expects from the virtual pipeline flags. ``--pipeline-schedule auto`` is checked here from its declared
values only; the decision runs in :func:`megatron_pp_ext.install` (:mod:`.auto_schedule`), which then
checks the chosen schedule with :func:`check_schedule_flags`.

Megatron-LM's own check that refuses interleaving at ``--pipeline-model-parallel-size 2`` without p2p
overlap runs before ours when a virtual pipeline flag is given; the plugin's executor has no such
restriction, so with a plugin schedule at PP=2 leave the virtual pipeline flag out.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Sequence
from typing import Any

from ..runtime.layer_map import SPLIT_FLAGS
from ..schedules import registry
from ..schedules.ir import ScheduleError
from ..schedules.schedule import Schedule
from . import fsdp_flags, moe_flags
from .config import (
    AUTO,
    ActivationLimit,
    LayerKindCosts,
    PipelineArgumentError,
    PipelineConfig,
    as_costs,
    check_schedule,
    parse_costs,
    parse_memory_limit,
    parse_schedule_name,
)
from .flags import GROUP_TITLE, add_arguments, flags_needing, values_from_args
from .uneven import layout_is_ours

__all__ = [
    "AUTO",
    "CPU_ARGV",
    "GROUP_TITLE",
    "ActivationLimit",
    "LayerKindCosts",
    "PipelineArgumentError",
    "PipelineConfig",
    "add_arguments",
    "as_costs",
    "check_auto_flags",
    "check_schedule",
    "check_schedule_flags",
    "config_from_args",
    "cpu_argv",
    "error_line",
    "layer_split_from_args",
    "microbatch_counts",
    "parse_costs",
    "parse_memory_limit",
    "parse_schedule_name",
    "pipeline_config_of",
    "validate_arguments",
    "validate_arguments_or_exit",
]

# Megatron flags a CPU / gloo run needs; ``scripts/pretrain_gpt.py`` puts them in front of the
# command line in CPU mode (so that the user's own flags still win).
CPU_ARGV = (
    "--distributed-backend",
    "gloo",
    "--transformer-impl",
    "local",
    "--no-gradient-accumulation-fusion",
    "--no-persist-layer-norm",
    "--no-masked-softmax-fusion",
    "--no-bias-gelu-fusion",
    "--no-bias-swiglu-fusion",
    "--no-bias-dropout-fusion",
    "--no-rope-fusion",
)

VIRTUAL_FLAGS = (
    ("num_virtual_stages_per_pipeline_rank", "--num-virtual-stages-per-pipeline-rank"),
    ("num_layers_per_virtual_pipeline_stage", "--num-layers-per-virtual-pipeline-stage"),
    ("pipeline_model_parallel_layout", "--pipeline-model-parallel-layout"),
)
UNEVEN_FLAGS = SPLIT_FLAGS  # megatron's uneven-split flags (runtime/layer_map.py)


# Resolved configurations by args object: kept out of ``args`` itself (which megatron pickles).
_CONFIGS: dict[int, tuple[Any, PipelineConfig]] = {}


def pipeline_config_of(args: Any) -> PipelineConfig | None:
    """The configuration :func:`validate_arguments` resolved for ``args`` (None if it did not run)."""
    entry = _CONFIGS.get(id(args))
    return entry[1] if entry is not None and entry[0]() is args else None


def _remember(args: Any, config: PipelineConfig) -> None:
    import weakref

    for key in [k for k, (ref, _) in _CONFIGS.items() if ref() is None]:
        del _CONFIGS[key]
    _CONFIGS[id(args)] = (weakref.ref(args), config)


# ---- validation -------------------------------------------------------------------------------------
def _given(args: Any, name: str) -> bool:
    value = getattr(args, name, None)
    return value is not None and value is not False


def _virtual_flag(args: Any) -> str | None:
    """The virtual pipeline flag the user gave (a layout string mapped onto a V / bidirectional placement's
    stages is not one: :mod:`.uneven`)."""
    ours = layout_is_ours(args)
    for name, flag in VIRTUAL_FLAGS:
        if _given(args, name) and not (ours and name == "pipeline_model_parallel_layout"):
            return flag
    return None


def microbatch_counts(args: Any) -> tuple[list[int], list[int]]:
    """Micro-batch counts per iteration of training (with batch-size ramp-up) and of evaluation."""
    dp = int(getattr(args, "data_parallel_size", 1) or 1)
    mbs = int(args.micro_batch_size)
    gbs = int(args.global_batch_size or mbs * dp)
    train = [gbs // (mbs * dp)]
    rampup = getattr(args, "rampup_batch_size", None)
    if rampup:
        start, increment = int(rampup[0]), int(rampup[1])
        sizes = range(start, gbs + 1, increment) if increment > 0 else [start]
        train = sorted({max(1, b // (mbs * dp)) for b in sizes} | set(train))
    evaluation: list[int] = []
    if int(getattr(args, "eval_iters", 0) or 0) > 0:
        eval_gbs = int(getattr(args, "eval_global_batch_size", None) or gbs)
        eval_mbs = int(getattr(args, "eval_micro_batch_size", None) or mbs)
        evaluation = [eval_gbs // (eval_mbs * dp)]
    return train, evaluation


_PARAMETER_FLAGS = (
    ("block_file", "--pipeline-block-file"),
    ("memory_limit", "--pipeline-memory-limit"),
    ("costs", "--pipeline-costs"),
    ("microbatch_group_size", "--microbatch-group-size-per-virtual-pipeline-stage"),
    ("unit_size", "--pipeline-unit-size"),
    ("v", None),  # the virtual pipeline flag the user gave
    ("m", "--global-batch-size"),
    ("p", "--pipeline-model-parallel-size"),
)


def _flag_for(message: str, config: PipelineConfig, kwargs: dict[str, object], virtual_flag: str | None) -> str:
    """The flag a generator's error is about (the parameter it names), else --pipeline-schedule."""
    for name, flag in _PARAMETER_FLAGS:
        if not re.search(rf"(?<![\w-]){name}(?![\w-])", message):
            continue
        if name in ("memory_limit", "costs", "microbatch_group_size") and name not in kwargs:
            continue
        if name == "v":
            if virtual_flag is None:
                continue
            return virtual_flag
        return flag or "--pipeline-schedule"
    return "--pipeline-schedule"


def config_from_args(args: Any) -> PipelineConfig:
    """The plugin configuration megatron's ``args`` ask for (no checks beyond parsing)."""
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    if layout_is_ours(args) and _virtual_flag(args) is None:
        vp = None  # megatron derived it from the layout string for its loop placement
    return PipelineConfig(
        **values_from_args(args),
        num_virtual_stages=int(vp) if vp else None,
        microbatch_group_size=getattr(args, "microbatch_group_size_per_vp_stage", None),
        num_layers=getattr(args, "num_layers", None),
        pipeline_parallel_size=int(getattr(args, "pipeline_model_parallel_size", 1) or 1),
        virtual_flag=_virtual_flag(args) or "--num-virtual-stages-per-pipeline-rank",
    )


def validate_arguments(args: Any) -> PipelineConfig:
    """Check the plugin's flags against megatron's; run after megatron's own validation.

    Raises :class:`PipelineArgumentError`. When a schedule needs more chunks per rank than
    megatron's virtual pipeline flags gave, sets ``args.virtual_pipeline_model_parallel_size``
    (and ``args.num_virtual_stages_per_pipeline_rank``) so that megatron builds them. Returns the
    resolved :class:`PipelineConfig` (also returned by :func:`pipeline_config_of`; nothing of ours goes
    into ``args``, which megatron pickles into checkpoints).
    """
    if getattr(args, "cpu", False):
        _check_cpu_flags(args)
    config = config_from_args(args)
    if config.schedule and config.schedule_file:
        raise PipelineArgumentError(
            "--pipeline-schedule-file",
            f"not allowed with argument --pipeline-schedule ({config.schedule}): give one or the other",
        )
    if config.trace_dir is not None and not config.selected:
        raise PipelineArgumentError("--pipeline-trace", "needs --pipeline-schedule or --pipeline-schedule-file")
    if config.profile_iterations is not None and config.profile_iterations < 0:
        raise PipelineArgumentError(
            "--pipeline-profile-iters", f"must be >= 0 (0 = no re-plan), got {config.profile_iterations}"
        )
    if not config.selected:
        for attr, flag in flags_needing("schedule"):
            if _given(args, attr):
                raise PipelineArgumentError(flag, "needs --pipeline-schedule (megatron's own schedule does not use it)")
        _remember(args, config)
        return config
    moe_flags.check_schedule(args)
    if config.post_validation_early and not config.post_validation:
        raise PipelineArgumentError("--pipeline-post-validation-early", "goes with --pipeline-post-validation")
    if config.schedule == AUTO:
        check_auto_flags(args, config)
        fsdp_flags.check_arguments(args)
        _remember(args, config)
        return config  # decided by install(args) (integration/auto_schedule.py), then check_schedule_flags
    for attr, flag in flags_needing("auto"):
        if _given(args, attr):
            raise PipelineArgumentError(flag, "needs --pipeline-schedule auto")
    if isinstance(config.costs, LayerKindCosts) and config.costs.profile is None:
        if not config.schedule:
            raise PipelineArgumentError(
                "--pipeline-costs",
                "per-layer-kind costs (KIND=F,B,W;...) go with a named schedule or auto; a schedule file takes "
                "F,B,W[,COMM] (one stage) or a profile file",
            )
        from .kind_costs import with_stage_costs  # each stage sums its layers' kinds

        p = config.pipeline_parallel_size or 1
        config.costs = with_stage_costs(args, config.costs, config.schedule, p, config.num_virtual_stages)
    fsdp_flags.check_arguments(args)
    if config.post_validation and config.fsdp:
        raise PipelineArgumentError(
            "--pipeline-post-validation", "wraps megatron's optimizer: not with --pipeline-fsdp (its own optimizer)"
        )
    return check_schedule_flags(args, config)


def check_schedule_flags(args: Any, config: PipelineConfig) -> PipelineConfig:
    """The selected schedule (named, from a file, or auto's choice) against megatron's flags: it builds for
    every micro-batch count of the run, the layers split over its stages, Transformer Engine can defer its
    weight gradients if it splits the backward; sets megatron's chunk count from its placement."""
    p = config.pipeline_parallel_size or 1
    virtual_flag = _virtual_flag(args)
    train_ms, eval_ms = microbatch_counts(args)
    dp = int(getattr(args, "data_parallel_size", 1) or 1)

    if config.schedule_file:
        try:
            schedule = config.load_file()
        except ScheduleError as exc:
            raise PipelineArgumentError("--pipeline-schedule-file", str(exc)) from None
        if len(set(train_ms + eval_ms)) > 1:
            raise PipelineArgumentError(
                "--pipeline-schedule-file",
                f"a schedule file fixes the micro-batch count ({schedule.num_microbatches}), but this run uses "
                f"{sorted(set(train_ms + eval_ms))} micro-batches per iteration (batch-size ramp-up or a different "
                "--eval-global-batch-size / --eval-micro-batch-size); make them equal or set --eval-iters 0",
            )
        ms = train_ms
    else:
        ms = sorted(set(train_ms + eval_ms))

    schedule = None
    for m in ms:
        try:
            schedule = config.build(p, m)
        except ScheduleError as exc:
            raise _schedule_error(exc, config, args, p, m, dp, virtual_flag) from None
    assert schedule is not None
    _check_layers(args, schedule, virtual_flag)
    _check_transformer_engine(args, config, schedule)
    config.layer_split = getattr(args, "pipeline_layer_split", None)
    _apply_chunks(args, config, schedule, virtual_flag)
    if config.trace_dir is not None:
        _check_trace_dir(config.trace_dir)
    _remember(args, config)
    return config


def _check_auto_layout(args: Any) -> None:
    """A layout string with ``auto``: one stage per pipeline rank, which megatron builds on its own loop
    placement and auto plans with (its one-chunk loop schedules map it). More stages would be chunks whose
    placement (megatron's interleaving or a V) auto chooses only after megatron has built them."""
    from ..schedules.values import parse_layer_layout

    flag, text = "--pipeline-model-parallel-layout", args.pipeline_model_parallel_layout
    p = int(getattr(args, "pipeline_model_parallel_size", 1) or 1)
    try:
        stages = len(parse_layer_layout(text))
    except ValueError as exc:
        raise PipelineArgumentError(flag, str(exc)) from None
    if stages != p:
        raise PipelineArgumentError(
            flag,
            f"{text!r} has {stages} stages: with --pipeline-schedule auto a layout gives one stage per pipeline "
            f"rank ({p} at --pipeline-model-parallel-size {p}); chunks per rank are auto's to choose (give {p} "
            "stages, name a schedule, or use --decoder-first/last-pipeline-num-layers)",
        )


def check_auto_flags(args: Any, config: PipelineConfig) -> None:
    """``--pipeline-schedule auto``'s flags, from their values alone (the decision runs in ``install``)."""
    if _given(args, "pipeline_model_parallel_layout"):
        _check_auto_layout(args)
    budget = config.memory_budget
    if budget is not None and not (math.isfinite(budget) and budget > 0):
        raise PipelineArgumentError("--pipeline-memory-budget", f"must be a number of GiB > 0, got {budget}")
    if budget is None and (bool(getattr(args, "cpu", False)) or not _cuda_available()):
        raise PipelineArgumentError("--pipeline-memory-budget", "--pipeline-schedule auto on CPU needs a budget")
    if config.costs is not None and not isinstance(config.costs, (tuple, LayerKindCosts)):
        from ..runtime.replan import LAYER_COSTS_KEY

        raise PipelineArgumentError(
            "--pipeline-costs",
            "auto takes F,B,W[,COMM] (ms of one stage), per-layer-kind KIND=F,B,W;... (ms of one layer), or a "
            f"profile file with per-layer-kind entries (its {LAYER_COSTS_KEY!r} key); this profile has per-stage "
            "costs only",
        )
    if config.overlap is not None and not 0.0 <= config.overlap <= 1.0:
        raise PipelineArgumentError("--pipeline-overlap", f"must be in [0, 1], got {config.overlap}")
    if config.profile_iterations == 0 and config.replan:
        raise PipelineArgumentError("--pipeline-profile-iters", "must be >= 1 with --pipeline-replan")


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return bool(torch.cuda.is_available())


def _schedule_error(
    exc: ScheduleError, config: PipelineConfig, args: Any, p: int, m: int, dp: int, virtual_flag: str | None
) -> PipelineArgumentError:
    message = str(exc)
    if config.schedule_file:
        return PipelineArgumentError("--pipeline-schedule-file", f"{config.schedule_file}: {message}")
    assert config.schedule is not None
    from ..schedules.generators.building_block import BuildingBlockError

    kwargs = config.generator_kwargs(p)
    flag = _flag_for(message, config, kwargs, virtual_flag)
    if config.block_file is not None and isinstance(exc, BuildingBlockError):
        flag = "--pipeline-block-file"
    if config.num_virtual_stages is not None and "chunk(s) per rank" in message:
        flag = virtual_flag or flag
    gbs = getattr(args, "global_batch_size", None)
    mbs = getattr(args, "micro_batch_size", None)
    context = f"p={p} (--pipeline-model-parallel-size), m={m} micro-batches per iteration"
    if gbs is not None and mbs is not None:
        context += f" (--global-batch-size {gbs} / (--micro-batch-size {mbs} x data-parallel {dp}))"
    if config.num_virtual_stages is not None:
        context += f", v={config.num_virtual_stages} ({virtual_flag or 'virtual pipeline size'})"
    flags = {
        "memory_limit": f"--pipeline-memory-limit {config.memory_limit}",
        "costs": "--pipeline-costs",
        "microbatch_group_size": "--microbatch-group-size-per-virtual-pipeline-stage",
        "block_file": "--pipeline-block-file",
        "unit_size": "--pipeline-unit-size",
    }
    for key, value in kwargs.items():
        if key != "v":
            shown = f"{value:g}" if isinstance(value, float) else str(value)
            context += f", {key}={shown} ({flags.get(key, key)})"
    constraints = registry.get(config.schedule).requirements
    return PipelineArgumentError(
        flag,
        f"pipeline schedule '{config.schedule}' cannot run with {context}: {message} "
        f"(valid for {config.schedule}: {constraints})",
    )


def layer_split_from_args(args: Any) -> Any:
    """Megatron's uneven-split flags as a :class:`~megatron_pp_ext.runtime.layer_map.LayerSplit`
    (raises ValueError on a layout string that does not parse)."""
    from ..runtime.layer_map import split_from_args

    return split_from_args(args)


def _check_uneven_split(args: Any, schedule: Schedule, given: list[str]) -> None:
    """Uneven splits under V / bidirectional placements: the flags split the placement's model stages."""
    from ..runtime.layer_map import LayerSplitError, stage_layer_counts

    flag = given[0]
    try:
        split = layer_split_from_args(args)
    except ValueError as exc:
        raise PipelineArgumentError("--pipeline-model-parallel-layout", str(exc)) from None
    num_layers = getattr(args, "num_layers", None)
    if num_layers is None:
        return
    placement = schedule.placement
    try:
        stage_layer_counts(num_layers, placement.stages_per_replica, split)
    except LayerSplitError as exc:
        where = (
            f"--pipeline-schedule {schedule.name}: {placement.style} placement, "
            f"{placement.stages_per_replica} model stages over {placement.num_ranks} ranks"
        )
        raise PipelineArgumentError(flag, f"{exc} ({where})") from None
    args.pipeline_layer_split = split


def _check_hybrid_pattern(args: Any, schedule: Schedule) -> None:
    """A hybrid layer pattern's segments against the schedule's placement (stage s builds segment s), and
    its layer types against what this run can build (``runtime/hybrid_pattern.py``)."""
    from ..runtime.hybrid_pattern import HybridPatternError, check_runnable, hybrid_layer_split

    flag, pattern = "--hybrid-layer-pattern", args.hybrid_layer_pattern
    try:
        split = hybrid_layer_split(pattern, schedule.placement, schedule.name, flag)
        if bool(getattr(args, "cpu", False)):
            from .hybrid import LOCAL_SYMBOLS

            check_runnable(pattern, LOCAL_SYMBOLS, "on CPU (megatron-core's local layers)", flag)
            if "E" in pattern and getattr(args, "add_bias_linear", False):
                raise HybridPatternError(
                    f"{flag} MoE layers ('E') on CPU need --disable-bias-linear (megatron-core's expert bias "
                    "fails on CPU)"
                )
    except HybridPatternError as exc:
        raise PipelineArgumentError(flag, str(exc).removeprefix(f"{flag} ")) from None
    args.pipeline_layer_split = split


def _check_layers(args: Any, schedule: Schedule, virtual_flag: str | None) -> None:
    placement = schedule.placement
    if getattr(args, "hybrid_layer_pattern", None):
        _check_hybrid_pattern(args, schedule)
        return
    uneven = [flag for attr, flag in UNEVEN_FLAGS if _given(args, attr)]
    layout_flag = "--pipeline-model-parallel-layout"
    if layout_flag in uneven and len(uneven) > 1:  # megatron's TransformerConfig refuses it with a traceback
        others = " / ".join(f for f in uneven if f != layout_flag)
        message = f"gives every stage's layers: not with {others} (give one or the other)"
        raise PipelineArgumentError(layout_flag, message)
    if uneven:
        from .uneven import mtp_layout_error

        mtp_error = mtp_layout_error(args)
        if mtp_error:
            raise PipelineArgumentError(layout_flag, mtp_error)
        if placement.style == "loop":
            return  # megatron splits the layers itself (and checks them)
        if layout_flag in uneven and virtual_flag is not None:
            raise PipelineArgumentError(
                layout_flag,
                f"not with {virtual_flag}: under {schedule.name}'s {placement.style} placement the layout's stages "
                "are the placement's model stages, which fix the chunks per rank (leave the virtual flag out)",
            )
        _check_uneven_split(args, schedule, uneven)
        return
    num_layers = getattr(args, "num_layers", None)
    if num_layers is None:
        return
    stages = placement.stages_per_replica
    if num_layers % stages:
        raise PipelineArgumentError(
            "--num-layers",
            f"{num_layers} layers do not split evenly into the {stages} pipeline stages of {schedule.name} "
            f"({placement.style} placement: {placement.num_ranks} ranks x {placement.chunks_per_rank} chunk(s)); "
            f"use a multiple of {stages}",
        )


def _apply_chunks(args: Any, config: PipelineConfig, schedule: Schedule, virtual_flag: str | None) -> None:
    chunks = schedule.chunks_per_rank
    current = getattr(args, "virtual_pipeline_model_parallel_size", None) or 1
    if current != chunks:
        if virtual_flag is not None:
            raise PipelineArgumentError(
                virtual_flag,
                f"{schedule.name} places {chunks} chunk(s) per rank ({schedule.placement.style} placement); "
                f"megatron's virtual pipeline size is {current}",
            )
        args.virtual_pipeline_model_parallel_size = chunks if chunks > 1 else None
        if chunks > 1 and getattr(args, "num_layers_per_virtual_pipeline_stage", None) is None:
            args.num_virtual_stages_per_pipeline_rank = chunks
    config.num_virtual_stages = chunks if chunks > 1 else None


def _check_transformer_engine(args: Any, config: PipelineConfig, schedule: Schedule) -> None:
    """A split schedule with the TE layer spec needs a TE whose layers defer their weight gradients."""
    if not schedule.splits_backward or getattr(args, "transformer_impl", "local") != "transformer_engine":
        return
    from ..runtime.te_wgrad import refusal, te_support_problem

    problem = te_support_problem()
    if problem is not None:
        raise PipelineArgumentError("--transformer-impl", refusal(problem, config.label))


def _check_cpu_flags(args: Any) -> None:
    needs = (
        ("distributed_backend", "gloo", "--distributed-backend gloo"),
        ("transformer_impl", "local", "--transformer-impl local"),
        ("gradient_accumulation_fusion", False, "--no-gradient-accumulation-fusion"),
    )
    for attr, value, flags in needs:
        if hasattr(args, attr) and getattr(args, attr) != value:
            raise PipelineArgumentError("--cpu", f"CPU mode needs {flags} (got {attr}={getattr(args, attr)!r})")
    moe_flags.check_cpu(args)


def _check_trace_dir(path: str) -> None:
    import os

    if os.path.exists(path) and not os.path.isdir(path):
        raise PipelineArgumentError("--pipeline-trace", f"{path} exists and is not a directory")


def validate_arguments_or_exit(args: Any, prog: str | None = None) -> PipelineConfig:
    """:func:`validate_arguments`; on error print ``prog: error: argument ...`` and exit with status 2."""
    try:
        return validate_arguments(args)
    except PipelineArgumentError as exc:
        import os

        if os.environ.get("RANK", "0") == "0":
            error_line(prog or os.path.basename(sys.argv[0]) or "megatron", exc)
        raise SystemExit(2) from None


def error_line(prog: str, message: object) -> None:
    """``prog: error: message`` on stderr in ONE write: ranks failing together under torchrun share the
    stream, and a line written in pieces (text, then its newline) can run into another rank's line."""
    sys.stderr.write(f"{prog}: error: {message}\n")  # print() writes the text and its newline separately
    sys.stderr.flush()


def cpu_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` with the flags a CPU run needs in front (explicit flags later in argv still win)."""
    return [*CPU_ARGV, *argv]
