"""Megatron-Bridge: run a plugin schedule in a Bridge recipe (``megatron.bridge.training.pretrain(cfg, ...)``).

Bridge has no schedule selector: its ``training/train.py`` imports megatron's ``get_forward_backward_func`` by
name from ``megatron.core.pipeline_parallel.schedules`` and ``training/eval.py`` from
``megatron.core.pipeline_parallel``; :func:`megatron_pp_ext.install` replaces every loaded ``megatron.*`` copy
(Bridge's included) and a Bridge module imported later picks the replacement up by name. This module adds
what a Bridge run needs beyond that, without importing Bridge (megatron-bridge is not a dependency):

* :func:`from_bridge_config`: the :class:`~.config.PipelineConfig` (with its :class:`~.entry.RunShape`) of a
  ``ConfigContainer``: model shape and parallel sizes from ``cfg.model`` (a ``TransformerConfig``), batch
  from ``cfg.train``, evaluation from ``cfg.validation``, the distributed optimizer from ``cfg.ddp``; the
  configuration is then checked as ``install(args)`` checks megatron's flags (``auto`` decided);
* :func:`refusal`: what a Bridge run cannot honour with a plugin schedule, one line naming the
  ``ConfigContainer`` field and what works (:class:`BridgeConfigError`);
* :func:`install`: both, then the Bridge-specific hooks (:func:`activate`): the chunk count the schedule's
  placement needs set on ``cfg.model.virtual_pipeline_model_parallel_size`` (Bridge's model provider builds
  that many chunks itself), the tied-embedding copy of V-shape and bidirectional placements after Bridge's
  own stage builder (``megatron.bridge.models.model_provider.get_model``), the placement's embedding ranks
  handed to megatron's group set-up (Bridge's ``pretrain()`` passes none), and a guard on the by-name copy of
  megatron's 1F1B function in Bridge's train module, which its ``dist_train`` path calls directly (it would
  silently run megatron's 1F1B instead of the schedule; :func:`refusal` stops that path first, from the
  configuration, as it stops multimodule models, whose evaluation calls megatron's 1F1B directly).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

from ._patching import Patcher
from .config import PipelineArgumentError, PipelineConfig
from .entry import RunShape

__all__ = [
    "BRIDGE_BUILDER",
    "BRIDGE_DIRECT_1F1B_CALLERS",
    "BridgeConfigError",
    "activate",
    "deactivate",
    "from_bridge_config",
    "install",
    "refusal",
    "uninstall",
]

#: Bridge's stage builder (megatron-bridge 0.6.2, ``models/model_provider.py``): builds the virtual stages itself
BRIDGE_BUILDER = ("megatron.bridge.models.model_provider", "get_model")
#: Bridge modules holding megatron's 1F1B function by name and calling it directly (0.6.2: the dist_train path;
#: its multimodule evaluation imports the function inside ``evaluate()``, refused from ``cfg.model`` instead)
BRIDGE_DIRECT_1F1B_CALLERS = ("megatron.bridge.training.train",)
DIRECT_1F1B = "forward_backward_pipelining_without_interleaving"
SCHEDULES_MODULE = "megatron.core.pipeline_parallel.schedules"


class BridgeConfigError(PipelineArgumentError):
    """A ``ConfigContainer`` field a plugin schedule cannot honour: ``ConfigContainer.FIELD: what works``."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(field, message)
        self.args = (f"ConfigContainer.{field}: {message}",)


def _full_iteration_cuda_graph(model: Any) -> bool:
    """Bridge's test for a CUDA graph around the whole forward-backward (``utils/cuda_graph.py``)."""
    impl = str(getattr(model, "cuda_graph_impl", "none") or "none")
    if impl == "full_iteration":
        return True
    if impl != "local":
        return False
    names: set[str] = set()
    for attr in ("cuda_graph_modules", "cuda_graph_scope"):
        value = getattr(model, attr, None)
        for item in value if isinstance(value, (list, tuple, set)) else [value] if value is not None else []:
            names.add(str(getattr(item, "name", item)).lower().rsplit(".", 1)[-1])
    return "full_iteration" in names


def refusal(cfg: Any, config: PipelineConfig | None = None) -> PipelineArgumentError | None:
    """What a Bridge run of ``cfg`` cannot do with a plugin schedule, as one error line; None when it can."""
    model = cfg.model
    if config is not None and config.fsdp:
        return PipelineArgumentError(
            "--pipeline-fsdp",
            "replaces megatron.training's DDP wrapping and optimizer set-up, which Megatron-Bridge never calls: "
            "use cfg.ddp.use_distributed_optimizer (or megatron's pretrain() with install(args))",
        )
    dist_train = getattr(model, "dist_train", None)
    if dist_train is not None and getattr(dist_train, "use_dist_train", False) is True:
        return BridgeConfigError(
            "model.dist_train.use_dist_train",
            "Bridge's dist_train path calls megatron's 1F1B directly (no schedule hook): set it False to run "
            "a plugin schedule, or leave the schedule out",
        )
    if type(model).__name__ in ("MegatronMIMOProvider", "MimoModelProvider"):
        return BridgeConfigError(
            "model",
            f"{type(model).__name__} is a multimodule model: Bridge trains and evaluates it with megatron's 1F1B "
            "directly and the plugin's executor runs single-module pipelines; leave the schedule out",
        )
    if getattr(model, "teacher", None) is not None or getattr(model, "kd_config", None) is not None:
        return BridgeConfigError(
            "model.teacher",
            "a distillation model: Bridge passes an adjust_tensor_shapes_fn for the stacked student and teacher "
            "activations, which the plugin's executor does not support; train without a plugin schedule",
        )
    if _full_iteration_cuda_graph(model):
        return BridgeConfigError(
            "model.cuda_graph_impl",
            f"{getattr(model, 'cuda_graph_impl', None)!r} with full-iteration scope captures the whole "
            "forward-backward as one CUDA graph, which cannot replay the executor's host-driven schedule: use "
            "cuda_graph_impl='none'",
        )
    return None


def _data_parallel_size(cfg: Any) -> int:
    dp = getattr(cfg, "data_parallel_size", None)
    if dp:
        return int(dp)
    import os

    model = cfg.model
    world = int(os.environ.get("WORLD_SIZE", "0") or 0)
    per_replica = 1
    for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
        per_replica *= int(getattr(model, name, 1) or 1)
    return max(1, world // per_replica) if world else 1


def run_shape(cfg: Any) -> RunShape:
    """The run's :class:`RunShape` from a ``ConfigContainer``."""
    train, validation = cfg.train, getattr(cfg, "validation", None)
    dp = _data_parallel_size(cfg)
    mbs = int(train.micro_batch_size)
    rampup = getattr(train, "rampup_batch_size", None)
    eval_iters = getattr(validation, "eval_iters", None) if validation is not None else None
    ddp = getattr(cfg, "ddp", None)
    return RunShape.from_transformer_config(
        cfg.model,
        micro_batch_size=mbs,
        global_batch_size=int(getattr(train, "global_batch_size", None) or mbs * dp),
        data_parallel_size=dp,
        rampup_batch_size=tuple(int(x) for x in rampup) if rampup else None,
        eval_iters=int(eval_iters or 0),
        eval_global_batch_size=getattr(validation, "eval_global_batch_size", None),
        eval_micro_batch_size=getattr(validation, "eval_micro_batch_size", None),
        use_distributed_optimizer=bool(getattr(ddp, "use_distributed_optimizer", False)),
    )


def from_bridge_config(cfg: Any, schedule: str | None = None, **fields: Any) -> PipelineConfig:
    """The plugin configuration of a Bridge ``ConfigContainer`` running ``schedule`` (``fields``: any other
    :class:`PipelineConfig` field, e.g. ``memory_budget=60.0`` for ``auto``). Raises the one-line
    :class:`BridgeConfigError` / :class:`PipelineArgumentError` of :func:`refusal` before anything is built."""
    run = run_shape(cfg)
    config = PipelineConfig(
        schedule=schedule, run=run, pipeline_parallel_size=run.pipeline_model_parallel_size, **fields
    )
    problem = refusal(cfg, config)
    if problem is not None:
        raise problem
    return config


_PATCHER = Patcher()
_GUARDED: list[tuple[Any, object]] = []


def _with_placement_ranks(current: Callable[..., Any]) -> Callable[..., Any]:
    """megatron's ``initialize_model_parallel`` given the active placement's embedding ranks where the caller
    passes none (Bridge's ``pretrain()``): V-shape puts both ends of the model on rank 0."""
    from . import layout

    def initialize_model_parallel(*args: Any, **kwargs: Any) -> Any:
        if layout.active() is not None:
            if kwargs.get("get_embedding_ranks") is None:
                kwargs["get_embedding_ranks"] = layout.embedding_ranks_for(None)
            if kwargs.get("get_position_embedding_ranks") is None:
                kwargs["get_position_embedding_ranks"] = layout.get_position_embedding_ranks
        return current(*args, **kwargs)

    return initialize_model_parallel


def _direct_1f1b_guard(label: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"megatron_pp_ext: Megatron-Bridge called megatron's 1F1B directly (its dist_train path), bypassing "
            f"the installed schedule {label}: refused (docs/bridge.md)"
        )

    refuse.megatron_pp_ext = True  # type: ignore[attr-defined]
    return refuse


def activate(label: str) -> None:
    """The Bridge-specific hooks (idempotent); :func:`deactivate` undoes them."""
    from . import layout

    if _PATCHER.active or _GUARDED:
        return
    parallel_state = importlib.import_module("megatron.core.parallel_state")
    current = parallel_state.initialize_model_parallel
    _PATCHER.replace("megatron.core.parallel_state", "initialize_model_parallel", _with_placement_ranks(current))
    module_name, attr = BRIDGE_BUILDER
    if module_name in sys.modules:  # Bridge imported by the recipe; never imported here
        _PATCHER.call_after(module_name, attr, layout.tie_local_embeddings)
    guard = _direct_1f1b_guard(label)
    original = getattr(importlib.import_module(SCHEDULES_MODULE), DIRECT_1F1B)
    for name in BRIDGE_DIRECT_1F1B_CALLERS:
        module = sys.modules.get(name)
        if module is not None and getattr(module, DIRECT_1F1B, None) is original:
            _GUARDED.append((module, original))
            setattr(module, DIRECT_1F1B, guard)


def deactivate() -> None:
    """Give megatron and Bridge their own functions back."""
    while _GUARDED:
        module, original = _GUARDED.pop()
        setattr(module, DIRECT_1F1B, original)
    _PATCHER.restore()


def install(cfg: Any, schedule: str | None = None, *, layout_hooks: bool | None = None, **fields: Any) -> Any:
    """Run ``schedule`` in the Bridge recipe ``cfg``: call before ``megatron.bridge.training.pretrain(cfg, ...)``.

    Checks ``cfg`` (:func:`from_bridge_config`), installs the plugin (:func:`megatron_pp_ext.install`), sets
    ``cfg.model.virtual_pipeline_model_parallel_size`` to the chunks per rank the schedule places and
    activates the Bridge hooks. Returns the installed ``forward_backward_func`` (None: no schedule given)."""
    from . import install as plugin

    config = from_bridge_config(cfg, schedule, **fields)
    func = plugin.install(config, layout_hooks=layout_hooks)
    if func is None:
        uninstall()
        return None
    resolved = plugin.installed()
    assert resolved is not None
    cfg.model.virtual_pipeline_model_parallel_size = resolved.num_virtual_stages
    deactivate()
    activate(resolved.label)
    return func


def uninstall() -> None:
    """Undo :func:`install` (the Bridge hooks, then the plugin)."""
    from . import install as plugin

    deactivate()
    plugin.uninstall()
