"""What a megatron feature adapter is (:class:`Feature`), what :func:`~..install.install` hands it
(:class:`Wiring`), and the registry the feature modules add themselves to (:func:`register`).

A feature is one megatron capability the plugin adapts (FSDP, MoE, post-validation, BitPipe's replicas,
layer layouts, checkpoints, the B/W split, tracing and re-planning, the ranks' configuration agreement).
It declares, in one module of :mod:`megatron_pp_ext.integration.features`:

* ``fields``: the :class:`~..config.PipelineConfig` fields (``--pipeline-*`` flags) it owns, and
  ``megatron_flags``: megatron's own flags it checks;
* :meth:`Feature.check`: its flag checks before any process group (every run, after the configuration is
  read; a check that needs a plugin schedule tests ``config.selected``), and :meth:`Feature.check_schedule`:
  the checks that need the built schedule (not run for ``--pipeline-schedule auto`` until it has decided);
* :meth:`Feature.prepare`: what it adds to the executor (options, a wrapper around each forward-backward
  call), and :meth:`Feature.activate`: the megatron patches it makes, undone by the :class:`Patcher`;
* :meth:`Feature.prepare_training`: what the training script sets up for every run, plugin schedule or not.

Features run in registration order (the import order of :mod:`megatron_pp_ext.integration.features`): the
order in which their checks report and their patches are made. Each method defaults to doing nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ...schedules.placement import Placement
    from ...schedules.schedule import Schedule
    from .._patching import Patcher
    from ..config import PipelineConfig

ForwardBackward = Callable[..., Any]
"""Megatron's ``forward_backward_func(**kwargs)``."""


@dataclass
class Wiring:
    """What :func:`~..install.install` builds the executor from, filled in by the features' ``prepare``.

    ``source``: the schedule per micro-batch count; ``tracer_factory``: a tracer per rank (or None);
    ``executor_options``: keywords of :func:`~...runtime.executor.make_forward_backward_func`;
    ``wrappers``: applied in order around the executor's function (the last one outermost).
    """

    config: PipelineConfig
    placement: Placement
    source: Callable[[int], Schedule]
    args_or_config: Any = None
    layout_hooks: bool | None = None
    tracer_factory: Callable[[int], Any] | None = None
    executor_options: dict[str, Any] = field(default_factory=dict)
    wrappers: list[Callable[[ForwardBackward], ForwardBackward]] = field(default_factory=list)

    def megatron_args(self) -> Any:
        """Megatron's args the configuration was read from (``get_args()`` when install() was given
        None); None when installed from a :class:`~..config.PipelineConfig`."""
        from ..config import PipelineConfig

        if isinstance(self.args_or_config, PipelineConfig):
            return None
        if self.args_or_config is None:
            from megatron.training import get_args

            return get_args()
        return self.args_or_config

    def wrap(self, wrapper: Callable[[ForwardBackward], ForwardBackward]) -> None:
        """Put ``wrapper`` around the forward-backward function built so far."""
        self.wrappers.append(wrapper)


class Feature:
    """One megatron feature the plugin adapts (see the module docstring). Subclass and register one instance."""

    name: str = ""
    fields: tuple[str, ...] = ()
    megatron_flags: tuple[str, ...] = ()

    def check(self, args: Any, config: PipelineConfig) -> None:
        """Refuse flags this feature cannot run with (raises :class:`~..config.PipelineArgumentError`)."""

    def check_schedule(self, args: Any, config: PipelineConfig, schedule: Schedule) -> None:
        """Refuse what the built ``schedule`` cannot run with this feature's flags; may record in ``config``."""

    def prepare(self, wiring: Wiring) -> None:
        """Add to the executor ``wiring`` builds (options, wrappers, the tracer)."""

    def activate(self, config: PipelineConfig, patcher: Patcher, wiring: Wiring) -> None:
        """Patch megatron for this feature, reversibly through ``patcher``."""

    def prepare_training(self, args: Any) -> None:
        """Set-up of the training script for every run (plugin schedule or not), after the flag checks."""


_REGISTERED: list[Feature] = []


def register(feature: Feature) -> Feature:
    """Add ``feature`` (once per name; a module imported again replaces its entry in place)."""
    for i, known in enumerate(_REGISTERED):
        if known.name == feature.name:
            _REGISTERED[i] = feature
            return feature
    _REGISTERED.append(feature)
    return feature


def registered() -> list[Feature]:
    """The registered features, in registration order."""
    return list(_REGISTERED)
