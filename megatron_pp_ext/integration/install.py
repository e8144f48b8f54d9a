"""``install()``: make megatron run a plugin schedule.

Megatron picks its schedule through ``get_forward_backward_func()``. It is defined in
``megatron.core.pipeline_parallel.schedules``, re-exported by ``megatron.core.pipeline_parallel``
and imported **by name** into ``megatron.training.training`` (0.19.2: ``train()`` and
``evaluate()`` call it there). :func:`install` replaces it in all three (and in any other loaded
megatron module holding it) with a function returning the executor's ``forward_backward_func``
for the selected schedule; :func:`uninstall` puts megatron back. With no plugin schedule
selected, :func:`install` changes nothing.

For placements other than megatron's loop (V-shape, bidirectional) it also activates the
layout hooks of :mod:`megatron_pp_ext.integration.layout`, so that megatron builds the chunks the
schedule expects. Call :func:`install` before the model is built (before ``pretrain()``).
"""

from __future__ import annotations

import atexit
import importlib
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from ..schedules import registry
from ..schedules.ir import ScheduleError
from ..schedules.placement import Placement, make_placement
from ..schedules.schedule import Schedule
from . import layout, moe_overlap, replicas
from ._patching import Patcher
from .arguments import AUTO, PipelineArgumentError, PipelineConfig, pipeline_config_of, validate_arguments

SCHEDULES_MODULE = "megatron.core.pipeline_parallel.schedules"
# Modules that import get_forward_backward_func by name in megatron-core 0.19.2 (imported here so
# that their copies are replaced too; any other loaded megatron module holding it is found by scan).
BY_NAME_IMPORTERS = ("megatron.core.pipeline_parallel", "megatron.training.training")
LAYOUT_HOOKS_ENV = "MEGATRON_PP_EXT_LAYOUT_HOOKS"


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
    if isinstance(args_or_config, PipelineConfig):
        if args_or_config.schedule == AUTO:
            raise PipelineArgumentError(
                "--pipeline-schedule", "auto is decided from megatron's args: call install(args), not install(config)"
            )
        return args_or_config
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


def _tracer_factory(trace_dir: str) -> tuple[Callable[[int], Any], set[int]]:
    from ..runtime.trace import Tracer

    param_storages: set[int] = set()
    static: dict[str, int] = {}  # filled with the model chunks' bytes on the first call (runtime/trace.py)

    def factory(rank: int) -> Any:
        import torch.distributed as dist

        tracer = Tracer(rank, param_storages)
        tracer.static = static
        directory = Path(trace_dir)
        if dist.is_initialized() and dist.get_world_size() > _megatron_pp_size():
            directory = directory / f"global_rank{dist.get_rank()}"  # several pipelines (DP / TP)
        atexit.register(tracer.write, directory)
        return tracer

    return factory, param_storages, static


def _profile_layers(args: Any, config: PipelineConfig) -> Any:
    """What a written profile needs for its per-layer-kind entries (:class:`~..runtime.replan.ProfileLayers`):
    the run's decoder layers by kind (a hybrid pattern's symbols, else ``dense``), its split, micro-batch size
    and TP; ``None`` without megatron's args or where a layer has no cost kind (MoE GPT layers, ``G D +``)."""
    from ..runtime.replan import ProfileLayers
    from .kind_costs import layer_kinds

    if args is None or not getattr(args, "num_layers", None) or not getattr(args, "micro_batch_size", None):
        return None
    kinds = layer_kinds(args)
    if kinds is None:
        return None
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    return ProfileLayers(kinds, config.layer_split, int(args.micro_batch_size), tp)


def _replanning(
    config: PipelineConfig, tracer_factory: Callable[[int], Any] | None, args: Any = None
) -> tuple[Any, Any]:
    """A schedule source that re-plans from measured costs, and the tracer factory that feeds it."""
    from megatron.training.utils import print_rank_0

    from ..runtime.replan import ReplanningSource
    from .arguments import as_costs

    def build(num_microbatches: int, costs: Any) -> Schedule:
        p = config.pipeline_parallel_size or _megatron_pp_size()
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
        profile_layers=_profile_layers(args, config) if config.profile_out else None,
    )

    def factory(rank: int) -> Any:
        return source.make_tracer(tracer_factory(rank) if tracer_factory is not None else None)

    return source, factory


def _wants_layout_hooks(placement: Placement, layout_hooks: bool | None) -> bool:
    if layout_hooks is None:
        layout_hooks = os.environ.get(LAYOUT_HOOKS_ENV, "") == "1"
    return layout_hooks or placement.style != "loop"


def install(args_or_config: Any = None, *, layout_hooks: bool | None = None) -> Callable[..., Any] | None:
    """Patch megatron to run the schedule that ``args_or_config`` selects (idempotent).

    ``args_or_config``: megatron's parsed args (validated here unless :func:`validate_arguments`
    already ran), a :class:`PipelineConfig`, or None for ``megatron.training.get_args()``.
    Returns the installed ``forward_backward_func``, or None (megatron untouched) when no plugin
    schedule is selected. ``layout_hooks``: force megatron's layer placement hooks on (True) for
    loop placements too; they are always on for other placements. Raises
    :class:`PipelineArgumentError` for invalid flags.
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
    no_trace: tuple[None, set[int], dict[str, int]] = (None, set(), {})
    tracer_factory, param_storages, static = _tracer_factory(config.trace_dir) if config.trace_dir else no_trace
    source: Callable[[int], Schedule] = make_schedule_source(config)
    if config.replan_iterations > 0:
        args = None if isinstance(args_or_config, PipelineConfig) else args_or_config
        if args is None and not isinstance(args_or_config, PipelineConfig):
            from megatron.training import get_args

            args = get_args()  # what _config_of read the configuration from
        source, tracer_factory = _replanning(config, tracer_factory, args)
    two_replicas = placement.num_replicas == 2
    executor_func = make_forward_backward_func(
        source,
        tracer_factory=tracer_factory,
        check_grads=config.check_grads,
        fsdp_max_unsharded=config.fsdp_max_unsharded if config.fsdp else None,
        replica_sync=replicas.ReplicaSyncForMegatron() if two_replicas else None,
    )
    from ..runtime import p2p

    p2p.set_check_messages(config.check_messages)

    def forward_backward_func(**kwargs: Any) -> Any:
        if config.post_validation:  # the last optimizer step validated, after (late) or before this pass
            from .post_validation_training import run

            return run(forward_backward, kwargs, late=not config.post_validation_early)
        return forward_backward(**kwargs)

    def forward_backward(**kwargs: Any) -> Any:
        if tracer_factory is not None and not param_storages:
            model = kwargs.get("model")
            for chunk in model if isinstance(model, list) else [model]:
                for param in chunk.parameters():
                    param_storages.add(param.untyped_storage().data_ptr())
            from ..runtime.trace import static_bytes_of

            static.update(static_bytes_of(model))
        result = executor_func(**kwargs)
        if two_replicas:  # the loss lands on two ranks: each gets every micro-batch's (losses.py)
            from .losses import gather_losses, pp_group_of

            result = gather_losses(source(kwargs["num_microbatches"]), pp_group_of(kwargs), result)
        return result

    forward_backward_func.megatron_pp_ext = True  # type: ignore[attr-defined]
    forward_backward_func.config = config  # type: ignore[attr-defined]

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
    patcher = Patcher()
    patcher.replace(SCHEDULES_MODULE, "get_forward_backward_func", get_forward_backward_func)
    _agree_before_groups(config, patcher)
    if _wants_layout_hooks(placement, layout_hooks):
        if config.num_layers is None:
            raise PipelineArgumentError(
                "--num-layers", f"{config.label} uses a {placement.style} placement: the layer count must be known"
            )
        layout.activate(placement, config.num_layers, config.layer_split)
    if two_replicas:
        replicas.activate(placement, patcher)
    if config.fsdp:  # per-chunk FSDP instead of megatron DDP (fsdp_training.py)
        from .fsdp_training import patch_megatron

        patch_megatron(patcher)
    if config.post_validation:  # wrap megatron's optimizer (post_validation_training.py)
        from . import post_validation_training

        post_validation_training.patch_megatron(patcher)
        patcher.on_restore(post_validation_training.forget)
    moe_overlap.activate(patcher, args_or_config)  # megatron's --overlap-moe-expert-parallel-comm
    if _splits_backward(config):
        try:
            _enable_backward_split(patcher, config.label)
        except BaseException:  # e.g. an unsupported Transformer Engine: leave megatron as it was
            patcher.restore()
            layout.deactivate()
            raise
    _STATE = _Installed(config, forward_backward_func, patcher)
    return forward_backward_func


def config_fields(config: PipelineConfig) -> list[tuple[str, str]]:
    """What every rank's plugin configuration must agree on, field by field (from the flag metadata)."""
    from .flags import agreement_fields

    return agreement_fields(config)


def config_text(config: PipelineConfig) -> str:
    """:func:`config_fields` in one line."""
    return " ".join(f"{name}={value}" for name, value in config_fields(config))


def _agree_before_groups(config: PipelineConfig, patcher: Patcher) -> None:
    """Before megatron builds its process groups, every rank checks it has the same configuration.

    Ranks with different placements would otherwise block in megatron's group set-up until
    ``--distributed-timeout-minutes``. Without megatron's parallel state module, nothing to do.
    """
    module_name = "megatron.core.parallel_state"
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return
    original = module.initialize_model_parallel
    fields = config_fields(config)

    def initialize_model_parallel(*args: Any, **kwargs: Any) -> Any:
        from ..runtime.agreement import agree_on_config

        agree_on_config(fields)
        return original(*args, **kwargs)

    patcher.replace(module_name, "initialize_model_parallel", initialize_model_parallel)


_UNSELECTED: Patcher | None = None


def agree_without_schedule(args: Any) -> None:
    """A rank of this project's training script started without ``--pipeline-schedule`` still joins the
    configuration agreement (as ``schedule=-``), so that a peer started with one stops at once with the
    disagreement naming both ranks, instead of waiting the agreement's full timeout for a rank that
    never comes (megatron's own training code is untouched otherwise). A rank running megatron without
    this project at all cannot be asked: there the timeout (``MEGATRON_PP_AGREE_TIMEOUT``) still applies."""
    global _UNSELECTED
    if _UNSELECTED is not None:
        return
    config = PipelineConfig(
        num_layers=getattr(args, "num_layers", None),
        pipeline_parallel_size=getattr(args, "pipeline_model_parallel_size", None) or 1,
    )
    _UNSELECTED = Patcher()
    _agree_before_groups(config, _UNSELECTED)


def _splits_backward(config: PipelineConfig) -> bool:
    """Does the selected schedule run separate B and W ops? (auto re-deciding: it may switch to one that does)"""
    if config.redecide is not None:
        return True
    if config.schedule_file:
        return config.load_file().splits_backward
    return bool(config.schedule) and registry.get(config.schedule).splits_backward


def _enable_backward_split(patcher: Patcher, label: str) -> None:
    """Weight-gradient deferral for megatron's linears, and for Transformer Engine layers when TE is present.

    TE layers (``Linear``, ``LayerNormLinear``, ``LayerNormMLP``, ``GroupedLinear``, which megatron's TE
    wrappers subclass) are built with TE's own ``delay_wgrad_compute=True`` and megatron DDP with
    ``ddp_config.delay_wgrad_compute`` (it then hooks those layers' parameters on the layer, for TE's
    ``backward_dw``); megatron's ``--delay-wgrad-compute`` (tied to its MoE overlap path) stays off. W runs
    TE's ``backward_dw()`` (see :mod:`megatron_pp_ext.runtime.te_wgrad`). A TE too old or without that
    API raises :class:`~megatron_pp_ext.runtime.te_wgrad.TEUnsupportedError`
    (:func:`~megatron_pp_ext.integration.arguments.validate_arguments` refuses it earlier, from the flags).
    """
    import importlib.util

    from ..runtime.wgrad import get_weight_grad_store
    from ..runtime.wgrad_hooks import install_wgrad_hooks, uninstall_wgrad_hooks

    install_wgrad_hooks()
    patcher.on_restore(uninstall_wgrad_hooks)
    if importlib.util.find_spec("transformer_engine") is None:
        return
    try:
        importlib.import_module("megatron.core.extensions.transformer_engine")
    except Exception:  # TE present but unusable (no CUDA): megatron's local layers are used
        return
    from ..runtime.te_wgrad import check_te_support, enable_te_wgrad, patch_for_split

    check_te_support(label)
    patch_for_split(patcher)
    provider = enable_te_wgrad()
    store = get_weight_grad_store()
    patcher.on_restore(lambda: store.providers.remove(provider) if provider in store.providers else None)


def uninstall() -> None:
    """Undo :func:`install` (megatron's own functions back everywhere); no-op when not installed."""
    global _STATE
    if _STATE is None:
        return
    _STATE.patcher.restore()
    layout.deactivate()
    _STATE = None
