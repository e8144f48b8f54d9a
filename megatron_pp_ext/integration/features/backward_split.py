"""The B/W split feature: for a schedule that runs a micro-batch's backward as two ops (B: input gradient,
W: weight gradient), megatron's linears, and Transformer Engine's layers when TE is present, defer their
weight gradients to the W op (:mod:`...runtime.wgrad_hooks`, :mod:`...runtime.te_wgrad`)."""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from ...schedules import registry
from ..config import PipelineArgumentError
from .base import Feature, Wiring, register

if TYPE_CHECKING:
    from ...schedules.schedule import Schedule
    from .._patching import Patcher
    from ..config import PipelineConfig


def splits_backward(config: PipelineConfig) -> bool:
    """Does the selected schedule run separate B and W ops? (auto re-deciding: it may switch to one that does)"""
    if config.redecide is not None:
        return True
    if config.schedule_file:
        return config.load_file().splits_backward
    return bool(config.schedule) and registry.get(config.schedule).splits_backward


def enable_backward_split(patcher: Patcher, label: str) -> None:
    """Weight-gradient deferral for megatron's linears, and for Transformer Engine layers when TE is present.

    TE layers (``Linear``, ``LayerNormLinear``, ``LayerNormMLP``, ``GroupedLinear``, which megatron's TE
    wrappers subclass) are built with TE's own ``delay_wgrad_compute=True`` and megatron DDP with
    ``ddp_config.delay_wgrad_compute`` (it then hooks those layers' parameters on the layer, for TE's
    ``backward_dw``); megatron's ``--delay-wgrad-compute`` (tied to its MoE overlap path) stays off. W runs
    TE's ``backward_dw()`` (see :mod:`megatron_pp_ext.runtime.te_wgrad`). A TE too old or without that
    API raises :class:`~megatron_pp_ext.runtime.te_wgrad.TEUnsupportedError` (:meth:`BackwardSplit.check_schedule`
    refuses it earlier, from the flags).
    """
    from ...runtime.wgrad import get_weight_grad_store
    from ...runtime.wgrad_hooks import install_wgrad_hooks, uninstall_wgrad_hooks

    install_wgrad_hooks()
    patcher.on_restore(uninstall_wgrad_hooks)
    if importlib.util.find_spec("transformer_engine") is None:
        return
    try:
        importlib.import_module("megatron.core.extensions.transformer_engine")
    except Exception:  # TE present but unusable (no CUDA): megatron's local layers are used
        return
    from ...runtime.te_wgrad import check_te_support, enable_te_wgrad, patch_for_split

    check_te_support(label)
    patch_for_split(patcher)
    provider = enable_te_wgrad()
    store = get_weight_grad_store()
    patcher.on_restore(lambda: store.providers.remove(provider) if provider in store.providers else None)


class BackwardSplit(Feature):
    name = "backward-split"
    megatron_flags = ("--transformer-impl",)

    def check_schedule(self, args: Any, config: PipelineConfig, schedule: Schedule) -> None:
        """A split schedule with the TE layer spec needs a TE whose layers defer their weight gradients."""
        if not schedule.splits_backward or getattr(args, "transformer_impl", "local") != "transformer_engine":
            return
        from ...runtime.te_wgrad import refusal, te_support_problem

        problem = te_support_problem()
        if problem is not None:
            raise PipelineArgumentError("--transformer-impl", refusal(problem, config.label))

    def activate(self, config: PipelineConfig, patcher: Patcher, wiring: Wiring) -> None:
        if splits_backward(config):  # an unsupported Transformer Engine raises: install() restores megatron
            enable_backward_split(patcher, config.label)


register(BackwardSplit())
