"""``--pipeline-post-validation`` under megatron's training loop (``pretrain()``).

Three patches, all reversible through install()'s :class:`~._patching.Patcher`:

* ``get_megatron_optimizer`` (megatron/core/optimizer/__init__.py, imported by name into
  megatron/training/training.py, which calls it in ``setup_model_and_optimizer``) returns its
  optimizer wrapped in :class:`~megatron_pp_ext.runtime.post_validation.PostValidatedOptimizer`;
* the installed ``forward_backward_func`` validates the last step before it runs (every use of the
  weights in training and evaluation goes through it): see :func:`validate_pending`;
* ``save_checkpoint`` (megatron/training/checkpointing.py, imported by name into training.py)
  validates first, so a checkpoint never holds an unvalidated step.

What stays synchronous: ``train_step`` (megatron/training/training.py) all-reduces
``update_successful``, the gradient norm and the zero count over the model-parallel group right
after the step, for its log and the learning-rate schedule. With post-validation those reductions
give the exact values (the last stage's state is complete; the norm only grows along the chain), but
they still wait for every stage's step; removing them (lagging the log by one iteration) is left.
"""

from __future__ import annotations

import atexit
from typing import Any

import torch

from ._patching import Patcher

_ACTIVE: list[Any] = []  # the wrapped optimizers of this process


def _summary() -> None:
    """One line per rank at exit: what post-validation did."""
    for optimizer in _ACTIVE:
        stats = optimizer.stats
        print(
            f"> megatron_pp_ext: post-validation, pipeline stage {optimizer.stage}: {stats.steps} steps, eager "
            f"{stats.eager}, {stats.rollbacks} rollbacks, {stats.redos} redone, snapshot {stats.snapshot_bytes} bytes",
            flush=True,
        )


def validate_pending() -> None:
    for optimizer in _ACTIVE:
        optimizer.validate()


def patch_megatron(patcher: Patcher) -> None:
    import importlib

    optimizer_module = importlib.import_module("megatron.core.optimizer")
    original = optimizer_module.get_megatron_optimizer

    def get_megatron_optimizer(config: Any, model_chunks: Any, *args: Any, **kwargs: Any) -> Any:
        from ..runtime.post_validation import wrap

        optimizer = original(config, model_chunks, *args, **kwargs)
        params = [p for chunk in model_chunks for p in chunk.parameters()]
        wrapped = wrap(optimizer, params, bool(config.use_distributed_optimizer))
        if not _ACTIVE:
            atexit.register(_summary)
        _ACTIVE.append(wrapped)
        if wrapped.stage == 0 and torch.distributed.get_rank() == 0:
            print("> megatron_pp_ext: optimizer post-validation on (docs/post_validation.md)", flush=True)
        return wrapped

    patcher.replace("megatron.core.optimizer", "get_megatron_optimizer", get_megatron_optimizer)
    try:
        checkpointing = importlib.import_module("megatron.training.checkpointing")
    except ImportError:  # megatron-core alone: no training loop to patch
        return
    original_save = checkpointing.save_checkpoint

    def save_checkpoint(*args: Any, **kwargs: Any) -> Any:
        validate_pending()
        return original_save(*args, **kwargs)

    patcher.replace("megatron.training.checkpointing", "save_checkpoint", save_checkpoint)


def forget() -> None:
    """install()'s uninstall: drop the wrapped optimizers (their validations are the caller's)."""
    _ACTIVE.clear()
