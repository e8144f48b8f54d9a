"""The plugin's configuration, :class:`PipelineConfig`: the single source of every ``--pipeline-*`` flag.

Each field that a megatron flag sets carries its :class:`Flag` (name, value parser, help, valid
values, whether and how it enters the ranks' agreement fingerprint) as dataclass metadata. From
these :mod:`.flags` generates the argparse group (``add_arguments``), the configuration read from
megatron's ``args``, the agreement fingerprint and the table in ``docs/flags.md``; the checks that
need megatron's other flags live in :mod:`.arguments`. Values shared with ``megatron-pp`` and the
planner (memory limit, costs, unit size) are read by :mod:`megatron_pp_ext.schedules.values`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import argtypes
from ..schedules import registry
from ..schedules.ir import ScheduleError
from ..schedules.schedule import Schedule
from ..schedules.values import (
    COSTS_RULE,
    LAYER_COSTS_RULE,
    MAX_VALUE,
    MEMORY_LIMIT_RULE,
    UNIT_SIZE_RULE,
    ActivationLimit,
)

__all__ = [
    "AUTO",
    "ActivationLimit",
    "Flag",
    "LayerKindCosts",
    "PipelineArgumentError",
    "PipelineConfig",
    "as_costs",
    "check_schedule",
    "parse_pipeline_costs",
    "parse_pipeline_memory_limit",
    "parse_schedule_name",
]

AUTO = "auto"  # --pipeline-schedule auto (planner/auto.py)
FSDP_FLAG = "--pipeline-fsdp"  # named in the FSDP feature's messages (features/chunk_fsdp.py, fsdp_training.py)


class PipelineArgumentError(ValueError):
    """A flag value (or combination) the plugin cannot run; prints like argparse's errors."""

    def __init__(self, flag: str, message: str) -> None:
        super().__init__(f"argument {flag}: {message}")
        self.flag = flag
        self.message = message


# ---- value parsers (argparse types: a bad value is one ``argument --flag: ...`` line) -------------------
# ``--pipeline-memory-limit``: N or Np activations -> ActivationLimit (:func:`..schedules.values.parse_memory_limit`)
parse_pipeline_memory_limit = argtypes.memory_limit


@dataclass(frozen=True)
class LayerKindCosts:
    """Measured times of one layer of each kind for one micro-batch (ms; ``KIND=F,B,W;...``, read by
    :func:`~megatron_pp_ext.schedules.values.parse_layer_costs`, the parser of ``plan --layer-costs``) at
    ``micro_batch`` and ``tp``. ``--pipeline-schedule auto`` costs each stage of the run's split from its
    layers with them. ``profile``: the per-stage costs a named schedule is built with: those of the profile file
    they came with, or, given on the command line, each stage's sum over its layers (set while the flags are
    checked, :mod:`.kind_costs`); ``None`` until then."""

    entries: tuple[tuple[str, tuple[float, float, float]], ...]
    micro_batch: int = 1
    tp: int = 1
    profile: Any = None

    @classmethod
    def parse(cls, text: str, profile: Any = None) -> LayerKindCosts:
        """From the ``KIND=F,B,W;...`` text (argparse's error on a bad one, naming what is valid)."""
        entries, micro_batch, tp = argtypes.layer_costs(text)
        return cls(tuple(sorted(entries.items())), micro_batch, tp, profile)


def parse_pipeline_costs(text: str) -> Any:
    """``--pipeline-costs``: ``F,B,W[,COMM]`` numbers (:func:`~megatron_pp_ext.schedules.values.parse_costs`),
    per-layer-kind ``KIND=F,B,W;...`` entries (text with ``=``: :class:`LayerKindCosts`), or the path of a JSON
    profile written by ``--pipeline-profile-out`` (text without a comma), which may carry per-layer-kind entries
    too (its ``layer_costs`` key, the same text)."""
    if "=" in str(text):
        return LayerKindCosts.parse(text)
    if "," not in str(text):
        from ..runtime.replan import LAYER_COSTS_KEY, load_profile

        try:
            profile, layers = load_profile(text)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise argparse.ArgumentTypeError(f"cannot read a cost profile from {text!r}: {exc}") from None
        if layers is None:
            return profile
        try:
            return LayerKindCosts.parse(layers, profile)
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"cost profile {text!r}, its {LAYER_COSTS_KEY!r}: {exc}") from None
    return argtypes.costs(text)


def parse_schedule_name(text: str) -> str:
    name = str(text).strip().lower()
    valid = [*registry.names(), AUTO]
    if name not in valid:
        raise argparse.ArgumentTypeError(f"unknown pipeline schedule {text!r}; valid schedules: {', '.join(valid)}")
    return name


# ---- flag metadata ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Flag:
    """How one :class:`PipelineConfig` field is given on megatron's command line.

    ``parse`` reads the text (an argparse type; ``None`` for a switch); ``keep_text``: argparse stores the
    checked text, not the parsed value (megatron pickles ``args`` into checkpoints, and torch's weights-only
    loader refuses this project's classes), and the configuration holds the parsed value. ``needs``:
    ``"schedule"`` (a plugin schedule, named or from a file) or ``"auto"`` (``--pipeline-schedule auto``).
    ``agree``: the field of the agreement fingerprint the value enters (flags sharing one are joined by
    ``/``), shown by ``show``. ``values`` and ``notes``: the valid values and more detail, for
    ``docs/flags.md``. ``{schedules}`` in ``help`` is replaced by the registered schedule names.
    """

    name: str
    help: str
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None
    keep_text: bool = False
    needs: str | None = None
    agree: str | None = None
    show: Callable[[Any], str] = str
    values: str = ""
    notes: str = ""  # docs/flags.md only: what the help line has no room for

    @property
    def switch(self) -> bool:
        return self.parse is None and self.metavar is None

    @property
    def dest(self) -> str:
        """The attribute of megatron's ``args``."""
        return self.name.lstrip("-").replace("-", "_")


def _flag(**spec: Any) -> dict[str, Flag]:
    """Field metadata: the field is set by the flag ``Flag(**spec)``."""
    return {"flag": Flag(**spec)}


def _agreed(name: str) -> dict[str, str]:
    """Field metadata: the ranks must agree on a field that megatron's own flags set (fingerprint ``name``)."""
    return {"agree": name}


def _name(value: Any) -> str:
    return value or "-"


def _file_content(path: str | None) -> str:
    """A file by its content, not its name (ranks may see one file under different paths)."""
    import hashlib
    from pathlib import Path

    if path is None:
        return "-"
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]
    except OSError as exc:
        return f"unreadable ({exc.strerror})"


_SCHEDULE = "a plugin schedule (--pipeline-schedule or --pipeline-schedule-file)"


# ---- the configuration --------------------------------------------------------------------------------
@dataclass
class PipelineConfig:
    """What :func:`megatron_pp_ext.install` needs; built from megatron's args or by hand.

    Field order is the order of the flags in ``--help`` and ``docs/flags.md``.
    ``num_virtual_stages``: chunks per rank the user asked for (``None``: the schedule's default).
    ``pipeline_parallel_size``: ``None`` = read megatron's parallel state when a schedule is built.
    """

    schedule: str | None = field(
        default=None,
        metadata=_flag(
            name="--pipeline-schedule",
            notes="auto evaluates every registered schedule and parameter (chunks per rank, memory limits p and 2p, "
            "costs) with the simulator and the memory model at the run's TP / PP / DP / micro-batch size, as "
            "`megatron-pp plan --schedules auto`, and runs the fastest that fits --pipeline-memory-budget; rank"
            " 0 prints the decision table. The decision runs in `install()`, which then checks the chosen "
            "schedule as it checks a named one.",
            metavar="NAME",
            parse=parse_schedule_name,
            agree="schedule",
            show=_name,
            values="a registered schedule (case-insensitive) or auto; not given: megatron's own schedule",
            help="Pipeline schedule to run (case-insensitive): {schedules}, or auto (the fastest that fits the memory "
            "budget). Default: megatron's own schedule.",
        ),
    )
    memory_budget: float | None = field(
        default=None,
        metadata=_flag(
            name="--pipeline-memory-budget",
            metavar="GIB",
            parse=argtypes.positive_float,
            needs="auto",
            values=f"GiB, finite in (0, {MAX_VALUE:g}]; required on CPU",
            help="Memory per rank (GiB) that --pipeline-schedule auto must fit (default: the GPU's memory).",
        ),
    )
    overlap: float | None = field(
        default=None,
        metadata=_flag(
            name="--pipeline-overlap",
            metavar="F",
            parse=argtypes.fraction,
            needs="auto",
            values="[0, 1]",
            help="With --pipeline-schedule auto: overlap factor of dualpipev's forward-and-backward pairs (a pair "
            "takes max + (1-F) x min; default 0 = one after the other, as without an overlap hook).",
        ),
    )
    replan: bool = field(
        default=False,
        metadata=_flag(
            name="--pipeline-replan",
            notes="The measured costs decide among the schedules of the running placement (the model chunks are "
            "built); rank 0 prints the new decision table.",
            needs="auto",
            help="With --pipeline-schedule auto: after --pipeline-profile-iters training iterations (default 3), "
            "decide again with the measured costs and switch schedule if another one is faster and fits.",
        ),
    )
    schedule_file: str | None = field(
        default=None,
        metadata=_flag(
            name="--pipeline-schedule-file",
            metavar="CSV",
            agree="file",
            show=_file_content,
            values="a schedule CSV with the run's p and m; not with --pipeline-schedule",
            help="Run a schedule from a file (megatron_pp_ext CSV format; validated before training).",
        ),
    )
    memory_limit: ActivationLimit | float | None = field(
        default=None,
        metadata=_flag(
            name="--pipeline-memory-limit",
            metavar="N|Np",
            parse=parse_pipeline_memory_limit,
            keep_text=True,
            needs="schedule",
            agree="memory_limit",
            values=MEMORY_LIMIT_RULE + "; memory-aware schedules only",
            help="Activation memory limit of memory-aware schedules, in one stage's activations for one "
            "micro-batch; 'Np' = N times the pipeline size (e.g. 2p).",
        ),
    )
    costs: Any = field(  # (F, B, W, COMM), a Costs object (a measured profile), or LayerKindCosts
        default=None,
        metadata=_flag(
            name="--pipeline-costs",
            notes="With auto: milliseconds of one 1F1B stage (L/p layers) for one micro-batch; COMM is not used there"
            " (the device model's hop time is). Per layer kind (`KIND=F,B,W;...`, the format of `megatron-pp plan "
            "--layer-costs`): auto costs each stage of the run's split (uneven flags, a hybrid pattern's `|` "
            "segments) from its layers, the device's cost model filling in kinds not given; a named schedule "
            "is built with each stage's sum over its layers (every kind its stages hold must be given; p2p cost 0), "
            "or with the measured per-stage costs of the profile file they came in. A profile file "
            "reaches auto only with per-layer-kind entries (its `layer_costs` key). Without the flag auto uses "
            "the device's cost model (docs/planner.md).",
            metavar="F,B,W[,COMM]|KIND=F,B,W;...|FILE",
            parse=parse_pipeline_costs,
            keep_text=True,
            needs="schedule",
            agree="costs",
            show=repr,
            values=COSTS_RULE + "; or " + LAYER_COSTS_RULE + "; or a JSON profile (no comma)",
            help="Relative forward, input-gradient backward, weight-gradient backward and p2p costs of one "
            "stage, for cost-aware schedules; or per layer kind (ms of one layer, KIND=F,B,W;...); or a JSON "
            "profile saved by --pipeline-profile-out. Given costs switch off the profiling re-plan.",
        ),
    )
    profile_iterations: int | None = field(
        default=None,
        metadata=_flag(
            name="--pipeline-profile-iters",
            metavar="N",
            parse=int,
            needs="schedule",
            agree="profile_iters",
            values="integer >= 0 (>= 1 with --pipeline-replan); default 3",
            help="Cost-aware schedules (zb-auto, v-zb): start from default costs, time every op over the "
            "first N training iterations, agree on one profile across ranks and re-plan (default 3; 0 = off).",
        ),
    )
    profile_out: str | None = field(
        default=None,
        metadata=_flag(
            name="--pipeline-profile-out",
            metavar="FILE",
            needs="schedule",
            values="a file path",
            help="Write the measured cost profile (JSON) to FILE, with per-layer-kind entries where its stages' "
            "layers determine them; pass it back later with --pipeline-costs FILE.",
        ),
    )
    block_file: str | None = field(  # building block (JSON) of v-block
        default=None,
        metadata=_flag(
            name="--pipeline-block-file",
            metavar="JSON",
            needs="schedule",
            agree="block",
            show=_file_content,
            values="a building-block JSON; v-block only",
            help="Building block for --pipeline-schedule v-block (JSON: per-rank start slots of F f B b W w "
            "and the repeat interval; format in megatron_pp_ext/schedules/generators/building_block.py). "
            "Default: the V-Half block.",
        ),
    )
    trace_dir: str | None = field(
        default=None,
        metadata=_flag(
            name="--pipeline-trace",
            metavar="DIR",
            values="a directory (created); needs " + _SCHEDULE,
            help="Write per-rank executor traces (op timings, live activation bytes) to DIR.",
        ),
    )
    check_grads: bool = field(
        default=False,
        metadata=_flag(
            name="--pipeline-check-grads",
            notes="The first training iteration is always checked; the flag extends the check to every iteration (two"
            " reductions per parameter per backward op).",
            needs="schedule",
            help="Check every training iteration (not only the first) that each trainable parameter received its "
            "gradient for every micro-batch and that no deferred weight gradient is left; raises naming them.",
        ),
    )
    check_messages: bool = field(
        default=False,
        metadata=_flag(
            name="--pipeline-check-messages",
            agree="check_messages",
            help="Send a small header (kind, stages, micro-batch) with every pipeline message and check it on "
            "arrival, so a message crossed by mismatched schedules fails where it lands (costs one extra tiny "
            "message per message).",
        ),
    )
    fsdp: bool = field(
        default=False,
        metadata=_flag(
            name=FSDP_FLAG,
            notes="megatron_pp_ext/integration/features/chunk_fsdp.py lists the megatron flags it refuses "
            "(one line each).",
            needs="schedule",
            agree="fsdp",
            help="Shard each model chunk's parameters, gradients and optimizer state over its data-parallel group "
            "(FSDP / ZeRO-3), gathered and resharded where the schedule places it, instead of megatron DDP "
            "(megatron_pp_ext.integration.fsdp_training).",
        ),
    )
    fsdp_max_unsharded: int | None = field(  # None: the schedule's declared limit, else 1
        default=None,
        metadata=_flag(
            name="--pipeline-fsdp-max-unsharded",
            metavar="N",
            parse=int,
            needs="schedule",
            agree="fsdp",
            values="integer >= 1; needs --pipeline-fsdp",
            help="With --pipeline-fsdp: model chunks a rank may hold gathered at once (default: the schedule's "
            "declared limit, else 1).",
        ),
    )
    unit_size: int | str | None = field(  # zeropp's scheduling unit
        default=None,
        metadata=_flag(
            name="--pipeline-unit-size",
            metavar="N|auto",
            parse=argtypes.unit_size,
            needs="schedule",
            agree="unit_size",
            values=UNIT_SIZE_RULE + "; zeropp only",
            help="zeropp: micro-batches per scheduling unit (default: all); 'auto' picks it with the simulator "
            "for --pipeline-costs under --pipeline-memory-limit.",
        ),
    )
    post_validation: bool = field(
        default=False,
        metadata=_flag(
            name="--pipeline-post-validation",
            notes="Needs megatron DDP (not --pipeline-fsdp). Validation is late by default: after the next "
            "iteration's forward-backward, which runs again on every stage when validation changed some stage's"
            " weights.",
            needs="schedule",
            agree="post_validation",
            help="Optimizer post-validation: no pipeline-wide reduction before the optimizer step; each stage steps "
            "on the statistics of the stages before it and validates against the complete ones before its next "
            "forward, rolling back and redoing the step where they differ (docs/post_validation.md).",
        ),
    )
    post_validation_early: bool = field(
        default=False,
        metadata=_flag(
            name="--pipeline-post-validation-early",
            needs="schedule",
            agree="post_validation",
            values="needs --pipeline-post-validation",
            help="With --pipeline-post-validation: validate the last step before the next forward-backward (the "
            "next iteration waits for the complete state) instead of after it (default: re-run the forward-backward "
            "when validation changed weights).",
        ),
    )
    cpu: bool = field(
        default=False,
        metadata=_flag(
            name="--cpu",
            help="Force CPU / gloo mode (megatron_pp_ext.integration.cpu shims), also used when CUDA is unavailable.",
        ),
    )
    # Set from megatron's own flags; the ranks must agree on them too.
    num_virtual_stages: int | None = field(default=None, metadata=_agreed("v"))
    num_layers: int | None = field(default=None, metadata=_agreed("layers"))
    pipeline_parallel_size: int | None = field(default=None, metadata=_agreed("p"))
    microbatch_group_size: int | None = field(default=None, metadata=_agreed("mb_group"))
    # The typed entry's model and batch (integration/entry.py, RunShape): what install(args) reads from megatron's
    # args; install(config) then checks the configuration as it checks the flags, and decides auto.
    run: Any = field(default=None, compare=False, repr=False)
    # Resolved while checking.
    layer_split: Any = None  # schedules.layer_split.LayerSplit for uneven splits under non-loop placements
    virtual_flag: str = "--num-virtual-stages-per-pipeline-rank"
    auto_table: str | None = None  # --pipeline-schedule auto: the decision table
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
            kwargs["memory_limit"] = limit.resolve(p) if isinstance(limit, ActivationLimit) else limit
        if self.costs is not None and info.takes("costs"):
            kwargs["costs"] = as_costs(self.costs)
        if self.block_file is not None:  # a schedule without blocks rejects it, naming block_file
            kwargs["block_file"] = self.block_file
        return kwargs

    @property
    def cost_aware(self) -> bool:
        return bool(self.schedule) and registry.get(self.schedule or "").takes("costs")

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
            from .. import analysis  # noqa: F401  (registers zeropp's unit size 'auto' with the registry)

            schedule = registry.generate(self.schedule, p, m, **self.generator_kwargs(p))
            if self.num_virtual_stages is not None and schedule.chunks_per_rank != self.num_virtual_stages:
                raise ScheduleError(
                    f"{self.schedule} places {schedule.chunks_per_rank} chunk(s) per rank "
                    f"({schedule.placement.style} placement), not {self.num_virtual_stages}"
                )
        check_schedule(schedule)
        return schedule


def as_costs(costs: Any) -> Any:
    """A :class:`~megatron_pp_ext.schedules.costs.Costs` from a Costs, an (F, B, W, COMM) tuple or the
    profile a :class:`LayerKindCosts` came with."""
    from ..schedules.costs import Costs

    if isinstance(costs, Costs):
        return costs
    if isinstance(costs, LayerKindCosts):
        if costs.profile is None:
            raise ScheduleError(
                "per-layer-kind costs have no per-stage costs yet (the flag checks sum them per stage; auto reads them)"
            )
        return as_costs(costs.profile)
    f, b, w, comm = (*tuple(costs), 0.0)[:4]
    return Costs(t_f=f, t_b=b, t_w=w, t_comm=comm)


def check_schedule(schedule: Schedule) -> None:
    """Full validation (dependencies, deadlock freedom) of a schedule; raises ScheduleError."""
    from ..analysis.schedule_check import validate

    validate(schedule)
