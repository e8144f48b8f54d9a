"""The tracing feature: ``--pipeline-trace`` (a per-rank trace of every op, :mod:`...runtime.trace`), the
re-plan from measured costs (``--pipeline-profile-iters``, ``--pipeline-profile-out``:
:mod:`...runtime.replan`) and the executor's own checks (``--pipeline-check-grads``,
``--pipeline-check-messages``)."""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...schedules.ir import ScheduleError
from ..config import PipelineArgumentError, as_costs
from .base import Feature, ForwardBackward, Wiring, register

if TYPE_CHECKING:
    from ...schedules.schedule import Schedule
    from ..config import PipelineConfig


def _pp_size() -> int:
    from megatron.core import parallel_state

    return int(parallel_state.get_pipeline_model_parallel_world_size())


def tracer_factory(trace_dir: str) -> tuple[Callable[[int], Any], set[int], dict[str, int]]:
    """A tracer per rank writing to ``trace_dir`` at exit, the parameter storages it leaves out of the
    activation figures, and the chunks' static bytes (both filled on the first forward-backward)."""
    from ...runtime.trace import Tracer

    param_storages: set[int] = set()
    static: dict[str, int] = {}  # filled with the model chunks' bytes on the first call (runtime/trace.py)

    def factory(rank: int) -> Any:
        import torch.distributed as dist

        tracer = Tracer(rank, param_storages)
        tracer.static = static
        directory = Path(trace_dir)
        if dist.is_initialized() and dist.get_world_size() > _pp_size():
            directory = directory / f"global_rank{dist.get_rank()}"  # several pipelines (DP / TP)
        atexit.register(tracer.write, directory)
        return tracer

    return factory, param_storages, static


def profile_layers(args: Any, config: PipelineConfig) -> Any:
    """What a written profile needs for its per-layer-kind entries (:class:`~...runtime.replan.ProfileLayers`):
    the run's decoder layers by kind (a hybrid pattern's symbols, else ``dense``), its split, micro-batch size
    and TP; ``None`` without megatron's args or where a layer has no cost kind (MoE GPT layers, ``G D +``)."""
    from ...runtime.replan import ProfileLayers
    from ..kind_costs import layer_kinds

    if args is None or not getattr(args, "num_layers", None) or not getattr(args, "micro_batch_size", None):
        return None
    kinds = layer_kinds(args)
    if kinds is None:
        return None
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    return ProfileLayers(kinds, config.layer_split, int(args.micro_batch_size), tp)


def replanning(
    config: PipelineConfig, tracer_factory: Callable[[int], Any] | None, args: Any = None
) -> tuple[Any, Any]:
    """A schedule source that re-plans from measured costs, and the tracer factory that feeds it."""
    from megatron.training.utils import print_rank_0

    from ...runtime.replan import ReplanningSource

    def build(num_microbatches: int, costs: Any) -> Schedule:
        p = config.pipeline_parallel_size or _pp_size()
        if costs is not None and config.redecide is not None:  # auto: decide again with the measured costs
            measured = config.redecide(as_costs(costs))
        else:
            measured = replace(config, costs=as_costs(costs)) if costs is not None else config
        try:
            return measured.build(p, num_microbatches)
        except ScheduleError as exc:
            raise ScheduleError(
                f"pipeline schedule {config.label}: cannot run {num_microbatches} micro-batches on {p} ranks: {exc}"
            ) from None

    source = ReplanningSource(
        build,
        config.replan_iterations,
        profile_out=config.profile_out,
        log=lambda text: print_rank_0(text),
        profile_layers=profile_layers(args, config) if config.profile_out else None,
    )

    def factory(rank: int) -> Any:
        return source.make_tracer(tracer_factory(rank) if tracer_factory is not None else None)

    return source, factory


def _param_storages_recorded(
    param_storages: set[int], static: dict[str, int]
) -> Callable[[ForwardBackward], ForwardBackward]:
    """On the first call: the model's parameter storages and static bytes, for the tracer."""

    def wrapper(forward_backward: ForwardBackward) -> ForwardBackward:
        def forward_backward_func(**kwargs: Any) -> Any:
            if not param_storages:
                model = kwargs.get("model")
                for chunk in model if isinstance(model, list) else [model]:
                    for param in chunk.parameters():
                        param_storages.add(param.untyped_storage().data_ptr())
                from ...runtime.trace import static_bytes_of

                static.update(static_bytes_of(model))
            return forward_backward(**kwargs)

        return forward_backward_func

    return wrapper


class Tracing(Feature):
    name = "tracing"
    fields = ("trace_dir", "profile_iterations", "profile_out", "check_grads", "check_messages")

    def check(self, args: Any, config: PipelineConfig) -> None:
        if config.trace_dir is not None and not config.selected:
            raise PipelineArgumentError("--pipeline-trace", "needs --pipeline-schedule or --pipeline-schedule-file")
        if config.profile_iterations is not None and config.profile_iterations < 0:
            raise PipelineArgumentError(
                "--pipeline-profile-iters", f"must be >= 0 (0 = no re-plan), got {config.profile_iterations}"
            )

    def check_schedule(self, args: Any, config: PipelineConfig, schedule: Schedule) -> None:
        path = config.trace_dir
        if path is not None and os.path.exists(path) and not os.path.isdir(path):
            raise PipelineArgumentError("--pipeline-trace", f"{path} exists and is not a directory")

    def prepare(self, wiring: Wiring) -> None:
        config = wiring.config
        if config.trace_dir:
            wiring.tracer_factory, param_storages, static = tracer_factory(config.trace_dir)
            wiring.wrap(_param_storages_recorded(param_storages, static))
        if config.replan_iterations > 0:
            wiring.source, wiring.tracer_factory = replanning(config, wiring.tracer_factory, wiring.megatron_args())
        wiring.executor_options["check_grads"] = config.check_grads
        wiring.executor_options["check_messages"] = config.check_messages


register(Tracing())
