"""``install()``: make megatron run a plugin schedule.

Megatron picks its schedule through ``get_forward_backward_func()``. It is defined in
``megatron.core.pipeline_parallel.schedules``, re-exported by ``megatron.core.pipeline_parallel``
and imported **by name** into ``megatron.training.training`` (0.19.2: ``train()`` and
``evaluate()`` call it there). :func:`install` replaces it in all three (and in any other loaded
megatron module holding it) with a function returning the executor's ``forward_backward_func``
for the selected schedule; :func:`uninstall` puts megatron back. With no plugin schedule
selected, :func:`install` changes nothing.

What each megatron feature the plugin adapts adds (the layout hooks for V-shape and bidirectional
placements, BitPipe's replicas, FSDP, post-validation, the B/W split, the tracer, ...) comes from its
module in :mod:`megatron_pp_ext.integration.features`. Call :func:`install` before the model is built
(before ``pretrain()``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from ..schedules import registry
from ..schedules.ir import ScheduleError
from ..schedules.placement import Placement, make_placement
from ..schedules.schedule import Schedule
from ._patching import Patcher
from .arguments import pipeline_config_of, validate_arguments
from .config import AUTO, PipelineArgumentError, PipelineConfig
from .features import Wiring, features

SCHEDULES_MODULE = "megatron.core.pipeline_parallel.schedules"
# Modules that import get_forward_backward_func by name in megatron-core 0.19.2 (imported here so
# that their copies are replaced too; any other loaded megatron module holding it is found by scan).
BY_NAME_IMPORTERS = ("megatron.core.pipeline_parallel", "megatron.training.training")


class _Installed:
    def __init__(self, config: PipelineConfig, forward_backward_func: Callable[..., Any], patcher: Patcher) -> None:
        self.config = config
        self.forward_backward_func = forward_backward_func
        self.patcher = patcher


_STATE: _Installed | None = None


def installed() -> PipelineConfig | None:
    """The configuration currently installed, or None."""
    return _STATE.config if _STATE is not None else None


def _config_of(args_or_config: Any) -> PipelineConfig:
    if isinstance(args_or_config, PipelineConfig):  # the typed entry: checked (and auto decided) with its run
        from .entry import resolve as resolve_typed

        return resolve_typed(args_or_config)[0]
    if args_or_config is None:
        from megatron.training import get_args

        args_or_config = get_args()
    config = pipeline_config_of(args_or_config)
    if config is None:
        config = validate_arguments(args_or_config)
    if config.schedule == AUTO:  # the planner's search runs here, not in the flag validation
        from .auto_schedule import resolve

        config = resolve(args_or_config, config)
    return config


def placement_of(config: PipelineConfig, p: int | None = None) -> Placement:
    """The placement ``config`` will use, without knowing the micro-batch count."""
    if config.schedule_file:
        return config.load_file().placement
    assert config.schedule is not None
    p = p or config.pipeline_parallel_size or _megatron_pp_size()
    style = registry.get(config.schedule).placement
    return make_placement(style, p, config.num_virtual_stages or 1)


def _megatron_pp_size() -> int:
    from megatron.core import parallel_state

    return int(parallel_state.get_pipeline_model_parallel_world_size())


def make_schedule_source(config: PipelineConfig) -> Callable[[int], Schedule]:
    """``schedule_for(num_microbatches)``: build, validate and cache the schedule per micro-batch count."""
    cache: dict[tuple[int, int], Schedule] = {}

    def schedule_for(num_microbatches: int) -> Schedule:
        p = config.pipeline_parallel_size or _megatron_pp_size()
        key = (p, num_microbatches)
        if key not in cache:
            try:
                cache[key] = config.build(p, num_microbatches)
            except ScheduleError as exc:
                raise ScheduleError(
                    f"pipeline schedule {config.label}: cannot run {num_microbatches} micro-batches on {p} ranks: {exc}"
                ) from None
        return cache[key]

    return schedule_for


def install(args_or_config: Any = None, *, layout_hooks: bool | None = None) -> Callable[..., Any] | None:
    """Patch megatron to run the schedule that ``args_or_config`` selects (idempotent).

    ``args_or_config``: megatron's parsed args (validated here unless :func:`validate_arguments`
    already ran), a :class:`PipelineConfig`, or None for ``megatron.training.get_args()``.
    Returns the installed ``forward_backward_func``, or None (megatron untouched) when no plugin
    schedule is selected. ``layout_hooks``: force megatron's layer placement hooks on (True) for
    loop placements too; they are always on for other placements. Raises
    :class:`PipelineArgumentError` for invalid flags.

    The executor is built from what each feature prepares (:mod:`.features`: the tracer, executor options,
    wrappers around the forward-backward), then each feature patches megatron, undone together on any
    failure and by :func:`uninstall`.
    """
    global _STATE
    config = _config_of(args_or_config)
    if not config.selected:
        uninstall()
        return None
    if _STATE is not None and _STATE.config == config:
        return _STATE.forward_backward_func
    uninstall()

    from ..runtime.executor import make_forward_backward_func

    try:
        placement = placement_of(config)
    except ScheduleError as exc:
        raise PipelineArgumentError("--pipeline-schedule", str(exc)) from None
    wiring = Wiring(config, placement, make_schedule_source(config), args_or_config, layout_hooks)
    for feature in features():
        feature.prepare(wiring)
    forward_backward_func = make_forward_backward_func(
        wiring.source, tracer_factory=wiring.tracer_factory, **wiring.executor_options
    )
    for wrapper in wiring.wrappers:
        forward_backward_func = wrapper(forward_backward_func)
    forward_backward_func = _marked(forward_backward_func, config)

    patcher = Patcher()
    _patch_get_forward_backward_func(patcher, forward_backward_func)
    try:
        for feature in features():
            feature.activate(config, patcher, wiring)
    except BaseException:  # e.g. an unsupported Transformer Engine: leave megatron as it was
        patcher.restore()
        raise
    _STATE = _Installed(config, forward_backward_func, patcher)
    return forward_backward_func


def _marked(executor_func: Callable[..., Any], config: PipelineConfig) -> Callable[..., Any]:
    """The function megatron calls, marked as the plugin's and carrying its configuration."""

    def forward_backward_func(**kwargs: Any) -> Any:
        return executor_func(**kwargs)

    forward_backward_func.megatron_pp_ext = True  # type: ignore[attr-defined]
    forward_backward_func.config = config  # type: ignore[attr-defined]
    return forward_backward_func


def _patch_get_forward_backward_func(patcher: Patcher, forward_backward_func: Callable[..., Any]) -> None:
    """Megatron's ``get_forward_backward_func`` returns ``forward_backward_func`` (multi-module pipelines
    excepted: megatron's own), in every module holding it by name."""
    schedules_module = importlib.import_module(SCHEDULES_MODULE)
    for name in BY_NAME_IMPORTERS:
        try:
            importlib.import_module(name)
        except ImportError:  # megatron.training absent or not importable: only megatron-core is patched
            pass
    original = schedules_module.get_forward_backward_func
    multi_module = getattr(schedules_module, "MultiModuleProcessGroupCollection", None)

    def get_forward_backward_func(
        pp_size: int | None = None, vp_size: int | None = None, schedule_pg_collection: Any = None
    ) -> Callable[..., Any]:
        """megatron_pp_ext: returns the executor running the selected pipeline schedule."""
        if multi_module is not None and isinstance(schedule_pg_collection, multi_module):
            return original(pp_size, vp_size, schedule_pg_collection)
        return forward_backward_func

    get_forward_backward_func.megatron_pp_ext = True  # type: ignore[attr-defined]
    patcher.replace(SCHEDULES_MODULE, "get_forward_backward_func", get_forward_backward_func)


def uninstall() -> None:
    """Undo :func:`install` (megatron's own functions back everywhere); no-op when not installed."""
    global _STATE
    if _STATE is None:
        return
    _STATE.patcher.restore()  # the layer-layout feature's hooks too (features/layer_placement.py)
    _STATE = None
