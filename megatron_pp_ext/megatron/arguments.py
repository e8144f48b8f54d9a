"""Megatron-style command-line flags of the plugin and their validation.

``add_arguments(parser)`` is an ``extra_args_provider`` for megatron's
``parse_and_validate_args``; :func:`validate_arguments` runs after it (megatron's own checks
have run and ``args.data_parallel_size`` is known) and before any process group exists.

Flag semantics (group "pipeline schedules (megatron_pp_ext)"):

``--pipeline-schedule NAME``
    A registered schedule (case-insensitive). Not given: megatron's own schedule runs and
    megatron is left untouched.
``--pipeline-schedule auto``
    Every registered schedule and parameter (chunks per rank, memory limits ``p`` and ``2p``, costs) is
    evaluated with the simulator and the memory model at the run's TP / PP / DP / micro-batch size
    (:mod:`megatron_pp_ext.planner.auto`, as ``megatron-pp plan --schedules auto``); the fastest that fits
    ``--pipeline-memory-budget`` GiB (CPU; on a GPU the default is its memory) runs, and rank 0 prints the
    decision table. ``--pipeline-costs F,B,W`` then means milliseconds of one 1F1B stage (L/p layers) for
    one micro-batch (its COMM is not used: the device model's hop time is); without it the device's cost
    model is used. The chosen schedule is built with the costs it was evaluated with.
``--pipeline-memory-budget GIB``
    Memory per rank for ``auto`` (weights, gradients, optimizer state and activations).
``--pipeline-overlap F``
    ``auto``: time the forward-and-backward pairs of ``dualpipev`` as ``max + (1-F) x min`` (as
    ``megatron-pp simulate --overlap F``); say how much your model's overlap hook hides. Default 0: one after
    the other, as the executor runs a pair without a hook.
``--pipeline-replan``
    ``auto``: after ``--pipeline-profile-iters`` (default 3) training iterations, decide again with the
    measured costs among the schedules of the running placement (the model chunks are built) and switch if
    another one is faster and fits; rank 0 prints the new decision table.

Where ``auto`` is decided: :func:`validate_arguments` checks the auto flags from their declared values only;
the decision (a planner search, :mod:`megatron_pp_ext.megatron.auto_schedule`) runs in
:func:`megatron_pp_ext.install`, which then checks the chosen schedule against megatron's flags as
:func:`validate_arguments` does for a named one (:func:`check_schedule_flags`).
``--pipeline-schedule-file CSV``
    A user schedule (see :mod:`megatron_pp_ext.schedules.schedule` for the format), checked
    with :func:`megatron_pp_ext.analysis.validate.validate`. Its rank count must equal
    ``--pipeline-model-parallel-size`` and its micro-batch count the run's. Excludes
    ``--pipeline-schedule``.
``--pipeline-memory-limit N | Np``
    Activation memory limit for memory-aware schedules, in activations of one stage for one
    micro-batch (``M_a``); ``Np`` means N times the pipeline size (``2p``). Schedules whose
    memory is fixed reject it.
``--pipeline-costs F,B,W[,COMM]``
    Relative times of one stage's forward, input-gradient backward, weight-gradient backward
    and one p2p hop, for cost-aware schedules (passed as ``costs=(F, B, W, COMM)``; COMM
    defaults to 0).
``--pipeline-trace DIR``
    Write per-rank traces (op timings, live activation bytes) of the executor to DIR.
``--pipeline-check-grads``
    Check, in every training iteration, that every trainable parameter of every model chunk received its
    gradient for every micro-batch that ran through the chunk, and that no weight-gradient work is left
    (:mod:`megatron_pp_ext.runtime.grad_check`). The first training iteration is always checked; the
    flag extends it to all (two reductions per parameter per backward op).
``--pipeline-fsdp`` [``--pipeline-fsdp-max-unsharded N``]
    Per-chunk FSDP instead of megatron DDP, gathered / resharded where the schedule places it (at most N
    chunks gathered at once); :mod:`megatron_pp_ext.megatron.fsdp_training`, which also lists what it refuses.
``--pipeline-unit-size N|auto``
    ``zeropp``'s scheduling unit (micro-batches, default m); ``auto`` picks it with the simulator for
    ``--pipeline-costs`` under ``--pipeline-memory-limit``. Other schedules reject it.
``--pipeline-post-validation``
    Optimizer post-validation (zero-bubble paper, section 4; docs/post_validation.md): the optimizer
    step reduces its statistics (gradient norm, found-inf, zero count) only within each pipeline stage,
    passes them stage to stage and steps eagerly; the complete state is validated before the next
    forward, rolling the step back and redoing it where it differs. Wraps megatron's optimizer
    (:mod:`megatron_pp_ext.runtime.post_validation`); needs a plugin schedule and megatron DDP (not
    ``--pipeline-fsdp``). Validation is *late* by default: after the next iteration's forward-backward,
    which runs again on every stage when validation changed some stage's weights.
``--pipeline-post-validation-early``
    With ``--pipeline-post-validation``: validate before the next forward-backward instead (no re-run, but
    the next iteration waits for the complete state).
``--cpu``
    Force CPU / gloo mode even when CUDA is available (it is also used when CUDA is not).

Chunks per rank (how many model chunks megatron builds on each rank) come from the schedule's
placement, and Megatron's usual flags set them, as a Megatron user expects:

* loop placement (``gpipe``, ``1f1b``, ``interleaved-1f1b``, ...): ``v`` is megatron's virtual
  pipeline size, from ``--num-virtual-stages-per-pipeline-rank`` or
  ``--num-layers-per-virtual-pipeline-stage``. Without either, the schedule's own default is
  used (``interleaved-1f1b``: 2) and written back to ``args.virtual_pipeline_model_parallel_size``
  so that megatron builds that many chunks. ``1f1b``/``gpipe`` with a virtual pipeline flag is an
  error (they run one chunk per rank).
* V-shape (2 chunks per rank) and bidirectional (4) placements fix the chunk count; a virtual
  pipeline flag must then agree with it (or be left out).
* ``--microbatch-group-size-per-virtual-pipeline-stage`` is passed to schedules that take a
  ``microbatch_group_size`` (``interleaved-1f1b``), as megatron's interleaved schedule uses it.

Megatron-LM's own check that refuses interleaving at ``--pipeline-model-parallel-size 2``
without p2p overlap runs before ours (inside ``parse_and_validate_args``) when a virtual
pipeline flag is given; the plugin's executor has no such restriction, so with a plugin
schedule at PP=2 leave the virtual pipeline flag out (the schedule's default chunk count is
used) or keep megatron's default p2p overlap setting.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .. import argtypes
from ..schedules import registry
from ..schedules.ir import ScheduleError
from ..schedules.schedule import Schedule

GROUP_TITLE = "pipeline schedules (megatron_pp_ext)"

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
UNEVEN_FLAGS = (
    ("decoder_first_pipeline_num_layers", "--decoder-first-pipeline-num-layers"),
    ("decoder_last_pipeline_num_layers", "--decoder-last-pipeline-num-layers"),
    ("pipeline_model_parallel_layout", "--pipeline-model-parallel-layout"),
    ("account_for_embedding_in_pipeline_split", "--account-for-embedding-in-pipeline-split"),
    ("account_for_loss_in_pipeline_split", "--account-for-loss-in-pipeline-split"),
)


class PipelineArgumentError(ValueError):
    """A flag value (or combination) the plugin cannot run; prints like argparse's errors."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"argument {flag}: {message}")
        self.flag = flag
        self.message = message


# ---- value types ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryLimit:
    """``--pipeline-memory-limit``: ``value`` activations, or ``value * p`` when ``per_rank_count``."""

    value: float
    per_rank_count: bool = False

    def resolve(self, num_ranks: int) -> float:
        return self.value * num_ranks if self.per_rank_count else self.value

    def __str__(self) -> str:
        text = f"{self.value:g}"
        return text + "p" if self.per_rank_count else text


def parse_memory_limit(text: str) -> MemoryLimit:
    raw = str(text).strip().lower()
    per = raw.endswith("p")
    number = raw[:-1].strip() if per else raw
    if per and not number:
        number = "1"
    try:
        value = float(number)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of activations or a multiple of the pipeline size like '2p', got {text!r}"
        ) from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"memory limit must be positive, got {text!r}")
    return MemoryLimit(value, per)


def parse_costs(text: str) -> Any:
    """``F,B,W[,COMM]`` numbers, or the path of a JSON profile written by ``--pipeline-profile-out``."""
    if "," not in str(text):
        from ..runtime.replan import load_costs

        try:
            return load_costs(text)
        except (OSError, ValueError, KeyError) as exc:
            raise argparse.ArgumentTypeError(f"cannot read a cost profile from {text!r}: {exc}") from None
    cells = [c.strip() for c in str(text).split(",")]
    if len(cells) not in (3, 4):
        raise argparse.ArgumentTypeError(f"expected F,B,W or F,B,W,COMM (3 or 4 numbers), got {text!r}")
    try:
        values = [float(c) for c in cells]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected numbers in F,B,W[,COMM], got {text!r}") from None
    if any(not math.isfinite(v) or v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"costs must be finite and >= 0, got {text!r}")
    if any(v <= 0 for v in values[:3]):
        raise argparse.ArgumentTypeError(f"F, B and W costs must be > 0, got {text!r}")
    if len(values) == 3:
        values.append(0.0)
    return values[0], values[1], values[2], values[3]


def parse_schedule_name(text: str) -> str:
    name = str(text).strip().lower()
    valid = [*registry.names(), AUTO]
    if name not in valid:
        raise argparse.ArgumentTypeError(f"unknown pipeline schedule {text!r}; valid schedules: {', '.join(valid)}")
    return name


def _checked_text(parse: Any) -> Any:
    """An argparse type that checks ``text`` with ``parse`` but keeps the text: megatron pickles ``args``
    into checkpoints, and torch's weights-only loader refuses this project's classes."""

    def check(text: str) -> str:
        parse(text)
        return str(text).strip()

    check.__name__ = parse.__name__
    return check


def _parsed(parse: Any, value: Any, flag: str) -> Any:
    """``value`` parsed if it is still text (args from argparse), as is otherwise (a hand-built config)."""
    if not isinstance(value, str):
        return value
    try:
        return parse(value)
    except argparse.ArgumentTypeError as exc:
        raise PipelineArgumentError(flag, str(exc)) from None


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


AUTO = "auto"  # --pipeline-schedule auto (planner/auto.py)


# ---- argparse ---------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the plugin's flags (an ``extra_args_provider`` for megatron); returns ``parser``."""
    group = parser.add_argument_group(title=GROUP_TITLE)
    names = ", ".join(registry.names())
    group.add_argument(
        "--pipeline-schedule",
        type=parse_schedule_name,
        default=None,
        metavar="NAME",
        help=f"Pipeline schedule to run (case-insensitive): {names}, or auto (the fastest that fits the memory "
        "budget). Default: megatron's own schedule.",
    )
    group.add_argument(
        "--pipeline-memory-budget",
        type=float,
        default=None,
        metavar="GIB",
        help="Memory per rank (GiB) that --pipeline-schedule auto must fit (default: the GPU's memory).",
    )
    group.add_argument(
        "--pipeline-overlap",
        type=argtypes.fraction,
        default=None,
        metavar="F",
        help="With --pipeline-schedule auto: overlap factor of dualpipev's forward-and-backward pairs (a pair "
        "takes max + (1-F) x min; default 0 = one after the other, as without an overlap hook).",
    )
    group.add_argument(
        "--pipeline-replan",
        action="store_true",
        default=False,
        help="With --pipeline-schedule auto: after --pipeline-profile-iters training iterations (default 3), "
        "decide again with the measured costs and switch schedule if another one is faster and fits.",
    )
    group.add_argument(
        "--pipeline-schedule-file",
        default=None,
        metavar="CSV",
        help="Run a schedule from a file (megatron_pp_ext CSV format; validated before training).",
    )
    group.add_argument(
        "--pipeline-memory-limit",
        type=_checked_text(parse_memory_limit),
        default=None,
        metavar="N|Np",
        help="Activation memory limit of memory-aware schedules, in one stage's activations for one "
        "micro-batch; 'Np' = N times the pipeline size (e.g. 2p).",
    )
    group.add_argument(
        "--pipeline-costs",
        type=_checked_text(parse_costs),
        default=None,
        metavar="F,B,W[,COMM]|FILE",
        help="Relative forward, input-gradient backward, weight-gradient backward and p2p costs of one "
        "stage, for cost-aware schedules; or a JSON profile saved by --pipeline-profile-out. Given costs "
        "switch off the profiling re-plan.",
    )
    group.add_argument(
        "--pipeline-profile-iters",
        type=int,
        default=None,
        metavar="N",
        help="Cost-aware schedules (zb-auto, v-zb): start from default costs, time every op over the "
        "first N training iterations, agree on one profile across ranks and re-plan (default 3; 0 = off).",
    )
    group.add_argument(
        "--pipeline-profile-out",
        default=None,
        metavar="FILE",
        help="Write the measured cost profile (JSON) to FILE; pass it back later with --pipeline-costs FILE.",
    )
    group.add_argument(
        "--pipeline-block-file",
        default=None,
        metavar="JSON",
        help="Building block for --pipeline-schedule v-block (JSON: per-rank start slots of F f B b W w "
        "and the repeat interval; format in megatron_pp_ext/schedules/generators/building_block.py). "
        "Default: the V-Half block.",
    )
    group.add_argument(
        "--pipeline-trace",
        default=None,
        metavar="DIR",
        help="Write per-rank executor traces (op timings, live activation bytes) to DIR.",
    )
    group.add_argument(
        "--pipeline-check-grads",
        action="store_true",
        default=False,
        help="Check every training iteration (not only the first) that each trainable parameter received its "
        "gradient for every micro-batch and that no deferred weight gradient is left; raises naming them.",
    )
    group.add_argument(
        "--pipeline-check-messages",
        action="store_true",
        default=False,
        help="Send a small header (kind, stages, micro-batch) with every pipeline message and check it on "
        "arrival, so a message crossed by mismatched schedules fails where it lands (costs one extra tiny "
        "message per message).",
    )
    group.add_argument(
        "--pipeline-fsdp",
        action="store_true",
        default=False,
        help="Shard each model chunk's parameters, gradients and optimizer state over its data-parallel group "
        "(FSDP / ZeRO-3), gathered and resharded where the schedule places it, instead of megatron DDP "
        "(megatron_pp_ext.megatron.fsdp_training).",
    )
    group.add_argument(
        "--pipeline-fsdp-max-unsharded",
        type=int,
        default=None,
        metavar="N",
        help="With --pipeline-fsdp: model chunks a rank may hold gathered at once (default: the schedule's "
        "declared limit, else 1).",
    )
    group.add_argument(
        "--pipeline-unit-size",
        type=argtypes.unit_size,
        default=None,
        metavar="N|auto",
        help="zeropp: micro-batches per scheduling unit (default: all); 'auto' picks it with the simulator "
        "for --pipeline-costs under --pipeline-memory-limit.",
    )
    group.add_argument(
        "--pipeline-post-validation",
        action="store_true",
        default=False,
        help="Optimizer post-validation: no pipeline-wide reduction before the optimizer step; each stage steps "
        "on the statistics of the stages before it and validates against the complete ones before its next "
        "forward, rolling back and redoing the step where they differ (docs/post_validation.md).",
    )
    group.add_argument(
        "--pipeline-post-validation-early",
        action="store_true",
        default=False,
        help="With --pipeline-post-validation: validate the last step before the next forward-backward (the "
        "next iteration waits for the complete state) instead of after it (default: re-run the forward-backward "
        "when validation changed weights).",
    )
    group.add_argument(
        "--cpu",
        action="store_true",
        default=False,
        help="Force CPU / gloo mode (megatron_pp_ext.megatron.cpu shims), also used when CUDA is unavailable.",
    )
    return parser


# ---- the resolved configuration ---------------------------------------------------------------------
@dataclass
class PipelineConfig:
    """What :func:`megatron_pp_ext.install` needs; built from megatron's args or by hand.

    ``num_virtual_stages``: chunks per rank the user asked for (``None``: the schedule's default).
    ``pipeline_parallel_size``: ``None`` = read megatron's parallel state when a schedule is built.
    """

    schedule: str | None = None
    schedule_file: str | None = None
    memory_limit: MemoryLimit | float | None = None
    costs: Any = None  # (F, B, W, COMM) or a Costs object
    trace_dir: str | None = None
    check_grads: bool = False
    profile_iterations: int | None = None
    profile_out: str | None = None
    block_file: str | None = None  # building block (JSON) of v-block
    layer_split: Any = None  # runtime.placement.LayerSplit for uneven splits under non-loop placements
    num_virtual_stages: int | None = None
    fsdp: bool = False  # --pipeline-fsdp
    fsdp_max_unsharded: int | None = None  # None: the schedule's declared limit, else 1
    microbatch_group_size: int | None = None
    unit_size: int | str | None = None  # zeropp's scheduling unit (--pipeline-unit-size)
    num_layers: int | None = None
    pipeline_parallel_size: int | None = None
    virtual_flag: str = "--num-virtual-stages-per-pipeline-rank"
    check_messages: bool = False  # --pipeline-check-messages
    post_validation: bool = False  # --pipeline-post-validation
    post_validation_early: bool = False  # --pipeline-post-validation-early
    auto_table: str | None = None  # --pipeline-schedule auto: the decision table
    memory_budget: float | None = None  # --pipeline-memory-budget (auto)
    overlap: float | None = None  # --pipeline-overlap (auto)
    replan: bool = False  # --pipeline-replan (auto)
    # auto with --pipeline-replan: measured Costs -> (the configuration to run, the decision table)
    redecide: Any = field(default=None, repr=False, compare=False)
    _file_schedule: Schedule | None = field(default=None, repr=False, compare=False)

    @property
    def selected(self) -> bool:
        return bool(self.schedule or self.schedule_file)

    @property
    def label(self) -> str:
        return self.schedule or f"file {self.schedule_file}"

    def generator_kwargs(self, p: int) -> dict[str, object]:
        assert self.schedule is not None
        info = registry.get(self.schedule)
        kwargs: dict[str, object] = {}
        if self.num_virtual_stages is not None:  # every schedule takes v; the declarations refuse a wrong one
            kwargs["v"] = self.num_virtual_stages
        if self.microbatch_group_size is not None and info.takes("microbatch_group_size"):
            kwargs["microbatch_group_size"] = self.microbatch_group_size
        if self.unit_size is not None:  # a schedule without units rejects it, naming unit_size
            kwargs["unit_size"] = self.unit_size
        if self.memory_limit is not None:
            limit = self.memory_limit
            kwargs["memory_limit"] = limit.resolve(p) if isinstance(limit, MemoryLimit) else limit
        if self.costs is not None and info.takes("costs"):
            kwargs["costs"] = as_costs(self.costs)
        if self.block_file is not None:  # a schedule without blocks rejects it, naming block_file
            kwargs["block_file"] = self.block_file
        return kwargs

    @property
    def cost_aware(self) -> bool:
        return bool(self.schedule) and registry.get(self.schedule).takes("costs")

    @property
    def replan_iterations(self) -> int:
        """Training iterations to profile before re-planning (0: no re-plan)."""
        if self.redecide is not None:  # auto decides again from the measured costs
            return 3 if self.profile_iterations is None else self.profile_iterations
        if not self.cost_aware or self.costs is not None:
            return 0
        return 3 if self.profile_iterations is None else self.profile_iterations

    def load_file(self) -> Schedule:
        if self._file_schedule is None:
            assert self.schedule_file is not None
            self._file_schedule = Schedule.load(self.schedule_file)
        return self._file_schedule

    def build(self, p: int, m: int) -> Schedule:
        """The schedule for ``p`` ranks and ``m`` micro-batches, validated; raises ScheduleError."""
        if self.schedule_file:
            schedule = self.load_file()
            if schedule.num_ranks != p:
                raise ScheduleError(
                    f"the file schedules {schedule.num_ranks} pipeline ranks, the run has "
                    f"--pipeline-model-parallel-size {p}"
                )
            if schedule.num_microbatches != m:
                raise ScheduleError(
                    f"the file schedules {schedule.num_microbatches} micro-batches, the run has {m} per iteration"
                )
        else:
            assert self.schedule is not None
            if self.schedule == AUTO:
                raise ScheduleError("--pipeline-schedule auto is decided by install(args) (megatron's args needed)")
            from ..analysis import zeropp_auto  # registry.generate, and zeropp's unit size 'auto'

            schedule = zeropp_auto.generate(self.schedule, p, m, **self.generator_kwargs(p))
            if self.num_virtual_stages is not None and schedule.chunks_per_rank != self.num_virtual_stages:
                raise ScheduleError(
                    f"{self.schedule} places {schedule.chunks_per_rank} chunk(s) per rank "
                    f"({schedule.placement.style} placement), not {self.num_virtual_stages}"
                )
        check_schedule(schedule)
        return schedule


def as_costs(costs: Any) -> Any:
    """A :class:`~megatron_pp_ext.analysis.simulate.Costs` from a Costs or an (F, B, W, COMM) tuple."""
    from ..analysis.simulate import Costs

    if isinstance(costs, Costs):
        return costs
    f, b, w, comm = (*tuple(costs), 0.0)[:4]
    return Costs(t_f=f, t_b=b, t_w=w, t_comm=comm)


def check_schedule(schedule: Schedule) -> None:
    """Full validation (dependencies, deadlock freedom) of a schedule; raises ScheduleError."""
    from ..analysis.validate import validate

    validate(schedule)


# ---- validation -------------------------------------------------------------------------------------
def _given(args: Any, name: str) -> bool:
    value = getattr(args, name, None)
    return value is not None and value is not False


def _virtual_flag(args: Any) -> str | None:
    for name, flag in VIRTUAL_FLAGS:
        if _given(args, name):
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
    name = getattr(args, "pipeline_schedule", None)
    if name is not None:
        try:
            name = parse_schedule_name(name)
        except argparse.ArgumentTypeError as exc:
            raise PipelineArgumentError("--pipeline-schedule", str(exc)) from None
    vp = getattr(args, "virtual_pipeline_model_parallel_size", None)
    return PipelineConfig(
        schedule=name,
        schedule_file=getattr(args, "pipeline_schedule_file", None),
        memory_limit=_parsed(
            parse_memory_limit, getattr(args, "pipeline_memory_limit", None), "--pipeline-memory-limit"
        ),
        costs=_parsed(parse_costs, getattr(args, "pipeline_costs", None), "--pipeline-costs"),
        check_messages=bool(getattr(args, "pipeline_check_messages", False)),
        post_validation=bool(getattr(args, "pipeline_post_validation", False)),
        post_validation_early=bool(getattr(args, "pipeline_post_validation_early", False)),
        block_file=getattr(args, "pipeline_block_file", None),
        trace_dir=getattr(args, "pipeline_trace", None),
        check_grads=bool(getattr(args, "pipeline_check_grads", False)),
        profile_iterations=getattr(args, "pipeline_profile_iters", None),
        profile_out=getattr(args, "pipeline_profile_out", None),
        num_virtual_stages=int(vp) if vp else None,
        fsdp=bool(getattr(args, "pipeline_fsdp", False)),
        fsdp_max_unsharded=getattr(args, "pipeline_fsdp_max_unsharded", None),
        microbatch_group_size=getattr(args, "microbatch_group_size_per_vp_stage", None),
        memory_budget=getattr(args, "pipeline_memory_budget", None),
        overlap=getattr(args, "pipeline_overlap", None),
        replan=bool(getattr(args, "pipeline_replan", False)),
        unit_size=getattr(args, "pipeline_unit_size", None),
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
        for attr, flag in (
            ("pipeline_memory_limit", "--pipeline-memory-limit"),
            ("pipeline_costs", "--pipeline-costs"),
            ("pipeline_profile_iters", "--pipeline-profile-iters"),
            ("pipeline_profile_out", "--pipeline-profile-out"),
            ("pipeline_block_file", "--pipeline-block-file"),
            ("pipeline_check_grads", "--pipeline-check-grads"),
            ("pipeline_fsdp", "--pipeline-fsdp"),
            ("pipeline_fsdp_max_unsharded", "--pipeline-fsdp-max-unsharded"),
            ("pipeline_unit_size", "--pipeline-unit-size"),
            ("pipeline_post_validation", "--pipeline-post-validation"),
            ("pipeline_post_validation_early", "--pipeline-post-validation-early"),
        ):
            if _given(args, attr):
                raise PipelineArgumentError(flag, "needs --pipeline-schedule (megatron's own schedule does not use it)")
        _remember(args, config)
        return config
    for attr, flag in (("overlap_moe_expert_parallel_comm", "--overlap-moe-expert-parallel-comm"),):
        if _given(args, attr):
            raise PipelineArgumentError(flag, "megatron's combined 1F1B schedule cannot run with --pipeline-schedule")
    if config.post_validation_early and not config.post_validation:
        raise PipelineArgumentError("--pipeline-post-validation-early", "goes with --pipeline-post-validation")
    if config.schedule == AUTO:
        check_auto_flags(args, config)
        from .fsdp_training import check_arguments as check_fsdp_arguments

        check_fsdp_arguments(args)
        _remember(args, config)
        return config  # decided by install(args) (megatron/auto_schedule.py), then check_schedule_flags
    for attr, flag in AUTO_FLAGS:
        if _given(args, attr):
            raise PipelineArgumentError(flag, "needs --pipeline-schedule auto")
    from .fsdp_training import check_arguments as check_fsdp_arguments

    check_fsdp_arguments(args)
    if config.post_validation and config.fsdp:
        raise PipelineArgumentError(
            "--pipeline-post-validation", "wraps megatron's optimizer: not with --pipeline-fsdp (its own optimizer)"
        )
    return check_schedule_flags(args, config)


AUTO_FLAGS = (
    ("pipeline_memory_budget", "--pipeline-memory-budget"),
    ("pipeline_overlap", "--pipeline-overlap"),
    ("pipeline_replan", "--pipeline-replan"),
)


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


def check_auto_flags(args: Any, config: PipelineConfig) -> None:
    """``--pipeline-schedule auto``'s flags, from their values alone (the decision runs in ``install``)."""
    budget = config.memory_budget
    if budget is not None and not (math.isfinite(budget) and budget > 0):
        raise PipelineArgumentError("--pipeline-memory-budget", f"must be a number of GiB > 0, got {budget}")
    if budget is None and (bool(getattr(args, "cpu", False)) or not _cuda_available()):
        raise PipelineArgumentError("--pipeline-memory-budget", "--pipeline-schedule auto on CPU needs a budget")
    if config.costs is not None and not isinstance(config.costs, tuple):
        raise PipelineArgumentError("--pipeline-costs", "auto takes F,B,W[,COMM] in ms, not a profile file")
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
    """Megatron's uneven-split flags as a :class:`~megatron_pp_ext.runtime.placement.LayerSplit`."""
    from ..runtime.placement import LayerSplit

    return LayerSplit(
        first=getattr(args, "decoder_first_pipeline_num_layers", None),
        last=getattr(args, "decoder_last_pipeline_num_layers", None),
        embedding=bool(getattr(args, "account_for_embedding_in_pipeline_split", False)),
        loss=bool(getattr(args, "account_for_loss_in_pipeline_split", False)),
    )


def _check_uneven_split(args: Any, schedule: Schedule) -> None:
    """Uneven splits under V / bidirectional placements: our layout splits the model slices."""
    from ..runtime.placement import LayerSplitError, stage_layer_counts

    split = layer_split_from_args(args)
    num_layers = getattr(args, "num_layers", None)
    if num_layers is None:
        return
    try:
        stage_layer_counts(num_layers, schedule.placement.stages_per_replica, split)
    except LayerSplitError as exc:
        flag = next(flag for attr, flag in UNEVEN_FLAGS if _given(args, attr))
        raise PipelineArgumentError(flag, f"{exc} ({schedule.name}, {schedule.placement.style} placement)") from None
    args.pipeline_layer_split = split


def _check_layers(args: Any, schedule: Schedule, virtual_flag: str | None) -> None:
    placement = schedule.placement
    uneven = [flag for attr, flag in UNEVEN_FLAGS if _given(args, attr)]
    if uneven:
        if placement.style == "loop":
            return  # megatron splits the layers itself (and checks them)
        if _given(args, "pipeline_model_parallel_layout"):
            raise PipelineArgumentError(
                "--pipeline-model-parallel-layout",
                f"custom layouts are supported with loop placements only; {schedule.name} uses a "
                f"{placement.style} placement (use --decoder-first/last-pipeline-num-layers or "
                "--account-for-embedding/loss-in-pipeline-split)",
            )
        _check_uneven_split(args, schedule)
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
