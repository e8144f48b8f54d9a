"""The configuration agreement: before megatron builds its process groups, every rank checks that it runs
the same plugin configuration (:func:`~...runtime.agreement.agree_on_config`); ranks with different
placements would otherwise block in megatron's group set-up until ``--distributed-timeout-minutes``."""

from __future__ import annotations

import importlib
from typing import Any

from .._patching import Patcher
from ..config import PipelineConfig
from .base import Feature, Wiring, register


def config_fields(config: PipelineConfig) -> list[tuple[str, str]]:
    """What every rank's plugin configuration must agree on, field by field (from the flag metadata)."""
    from ..flags import agreement_fields

    return agreement_fields(config)


def config_text(config: PipelineConfig) -> str:
    """:func:`config_fields` in one line."""
    return " ".join(f"{name}={value}" for name, value in config_fields(config))


def agree_before_groups(config: PipelineConfig, patcher: Patcher) -> None:
    """Megatron's ``initialize_model_parallel`` first agrees on ``config`` with every rank (without megatron's
    parallel state module, nothing to do)."""
    module_name = "megatron.core.parallel_state"
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return
    original = module.initialize_model_parallel
    fields = config_fields(config)

    def initialize_model_parallel(*args: Any, **kwargs: Any) -> Any:
        from ...runtime.agreement import agree_on_config

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
    agree_before_groups(config, _UNSELECTED)


class ConfigAgreement(Feature):
    name = "agreement"

    def activate(self, config: PipelineConfig, patcher: Patcher, wiring: Wiring) -> None:
        agree_before_groups(config, patcher)


register(ConfigAgreement())
