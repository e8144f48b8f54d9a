"""megatron_pp_ext: pipeline-parallel schedules for stock megatron-core.

A Megatron-LM training script needs a few lines (``patches/`` has them for ``pretrain_gpt.py``)::

    import megatron_pp_ext
    args = parse_and_validate_args(extra_args_provider=megatron_pp_ext.add_arguments, ...)
    megatron_pp_ext.validate_arguments_or_exit(args)  # the plugin's flags, before any process group
    megatron_pp_ext.install(args)  # before pretrain(); decides --pipeline-schedule auto; no-op without a schedule
    pretrain(..., get_embedding_ranks=megatron_pp_ext.embedding_ranks_for(get_embedding_ranks),
             get_position_embedding_ranks=megatron_pp_ext.get_position_embedding_ranks)

(the last two only matter for V-shape / bidirectional placements, where the embedding and the
loss do not sit on the first and last pipeline ranks).

The names below are imported lazily (``import megatron_pp_ext`` stays free of torch/megatron).
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "add_arguments": "megatron_pp_ext.integration.flags",
    "validate_arguments": "megatron_pp_ext.integration.arguments",
    "validate_arguments_or_exit": "megatron_pp_ext.integration.arguments",
    "PipelineConfig": "megatron_pp_ext.integration.config",
    "pipeline_config_of": "megatron_pp_ext.integration.arguments",
    "install": "megatron_pp_ext.integration.install",
    "uninstall": "megatron_pp_ext.integration.install",
    "chunk_layouts_for_this_rank": "megatron_pp_ext.integration.layout",
    "embedding_ranks_for": "megatron_pp_ext.integration.layout",
    "get_position_embedding_ranks": "megatron_pp_ext.integration.layout",
    "enable_cpu_mode": "megatron_pp_ext.integration.cpu",
    "enable_cpu_training_mode": "megatron_pp_ext.integration.cpu",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'megatron_pp_ext' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
