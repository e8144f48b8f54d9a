"""``--pipeline-post-validation`` under megatron's training loop (``pretrain()``).

Patches, all reversible through install()'s :class:`~._patching.Patcher`:

* ``get_megatron_optimizer`` (megatron/core/optimizer/__init__.py, imported by name into
  megatron/training/training.py, which calls it in ``setup_model_and_optimizer``) returns its
  optimizer wrapped in :class:`~megatron_pp_ext.runtime.post_validation.PostValidatedOptimizer`;
* the installed ``forward_backward_func`` runs through :func:`run`: *late* validation (default) runs the
  iteration's forward-backward on the eagerly stepped weights, then validates the last step, and when
  that changed some stage's weights (every stage knows it from the complete state) clears the
  gradients and runs the same micro-batches again (:class:`_Replay`); *early* validation
  (``--pipeline-post-validation-early``) validates before it. Evaluation (``forward_only``) always
  validates first;
* ``save_checkpoint`` (megatron/training/checkpointing.py, imported by name into training.py)
  validates first, so a checkpoint never holds an unvalidated step, and ``train`` (training.py,
  called by ``pretrain``) validates when it returns, so the model ``pretrain()`` leaves is validated.

* ``train_step``'s (megatron/training/training.py) post-step all-reduces of ``update_successful``, the
  gradient norm and the zero count over the model-parallel group, and ``training_log``'s of the learning
  rate, run over the stage's tensor-parallel group when every step's ``update_successful`` is final (no
  loss scaler, no skip threshold): see :func:`_stage_local`. With a loss scaler they stay as megatron has
  them (exact values: the last stage's state is complete, the norm only grows along the chain).
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ._patching import Patcher

_ACTIVE: list[Any] = []  # the wrapped optimizers of this process
# Testing aid: with MEGATRON_PP_EXT_POST_VALIDATION_LOG=PATH every rank writes PATH.rank<global rank> at exit
# (JSON: its stages' statistics and EVENTS).
LOG_ENV = "MEGATRON_PP_EXT_POST_VALIDATION_LOG"
# In call order on this rank: ("forward", n) first forward of the n-th forward-backward (training only,
# re-runs included), ("step", 0) an optimizer step, ("received", 0) the complete state of the last step
# received (validate()), ("rerun", n) the n-th forward-backward is run again.
EVENTS: list[tuple[str, int]] = []
# Called with "start" before a training forward-backward and "discard" when its results are dropped
# (it is run again): e.g. scripts/pretrain_gpt.py's loss recorder.
_LISTENERS: list[Callable[[str], None]] = []
_CALLS = [0]
_STAGE_LOCAL = [0]  # post-step reductions done over the stage instead of the model-parallel group


def add_listener(listener: Callable[[str], None]) -> None:
    _LISTENERS.append(listener)


def _summary() -> None:
    """One line per rank at exit: what post-validation did."""
    import dataclasses

    for optimizer in _ACTIVE:
        stats = optimizer.stats
        line = (
            f"> megatron_pp_ext: post-validation, pipeline stage {optimizer.stage}: {stats.steps} steps, eager "
            f"{stats.eager}, {stats.rollbacks} rollbacks, {stats.redos} redone, {stats.reruns} forward-backward "
            f"re-runs, snapshot {stats.snapshot_bytes} bytes\n"
        )
        sys.stdout.write(line)  # one write with its newline: ranks share the pipe, unbuffered under torchrun
        sys.stdout.flush()
    path = os.environ.get(LOG_ENV)
    if path and _ACTIVE:
        record = {
            "stages": [{"stage": o.stage, **dataclasses.asdict(o.stats)} for o in _ACTIVE],
            "events": EVENTS,
            "stage_local_reductions": _STAGE_LOCAL[0],
        }
        with open(f"{path}.rank{_ACTIVE[0].rank}", "w") as out:
            json.dump(record, out)


def validate_pending() -> None:
    for optimizer in _ACTIVE:
        optimizer.validate()


def _changed_somewhere() -> bool:
    """After validate_pending(): whether some stage's weights changed (the same answer on every rank)."""
    return any([optimizer.weights_changed_somewhere() for optimizer in _ACTIVE])  # every flag cleared


class _Replay:
    """Records what the data iterator(s) of a forward-backward hand out, to hand the same items out again."""

    def __init__(self, data_iterator: Any) -> None:
        self.original = data_iterator
        self.seen: dict[int, list[Any]] = {}

    def _map(self, fn: Callable[[int, Any], Any]) -> Any:
        if isinstance(self.original, list):
            return [fn(i, it) for i, it in enumerate(self.original)]
        return fn(0, self.original)

    def recording(self) -> Any:
        def record(i: int, it: Any) -> Any:
            if it is None:
                return None
            seen = self.seen.setdefault(i, [])

            def items() -> Iterator[Any]:
                while True:
                    try:
                        item = next(it)
                    except StopIteration:
                        return
                    seen.append(item)
                    yield item

            return items()

        return self._map(record)

    def replaying(self) -> Any:
        def replay(i: int, it: Any) -> Any:
            if it is None:
                return None

            def items() -> Iterator[Any]:
                yield from self.seen.get(i, [])
                while True:
                    try:
                        yield next(it)
                    except StopIteration:
                        return

            return items()

        return self._map(replay)


class _RandomState:
    """The random number generators a forward-backward draws from (dropout): torch's CPU and
    accelerator generators and megatron's model-parallel RNG tracker (``tensor_parallel.random``)."""

    def __init__(self) -> None:
        from megatron.core.tensor_parallel import random as mrandom

        self.cpu = torch.get_rng_state()
        self.accelerator = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        tracker = mrandom.get_cuda_rng_tracker()
        self.tracker = {name: state.clone() for name, state in tracker.get_states().items()}

    def restore(self) -> None:
        from megatron.core.tensor_parallel import random as mrandom

        torch.set_rng_state(self.cpu)
        if self.accelerator is not None:
            torch.cuda.set_rng_state_all(self.accelerator)
        mrandom.get_cuda_rng_tracker().set_states({name: state.clone() for name, state in self.tracker.items()})


def _observed(forward_step_func: Callable[..., Any], call: int) -> Callable[..., Any]:
    """``forward_step_func`` recording its first use in this forward-backward as ("forward", call)."""
    first = [True]

    @functools.wraps(forward_step_func)
    def forward_step(*args: Any, **kwargs: Any) -> Any:
        if first[0]:
            first[0] = False
            EVENTS.append(("forward", call))
        return forward_step_func(*args, **kwargs)

    return forward_step


def run(forward_backward: Callable[..., Any], kwargs: dict[str, Any], late: bool) -> Any:
    """One forward-backward of megatron's training loop (or evaluation) with the last step validated:
    before it (early, and for ``forward_only``), or after it (late), running it again on the validated
    weights when validation changed some stage's weights. Returns the losses of the run that counts."""
    if not _ACTIVE or kwargs.get("forward_only") or not late:
        validate_pending()
        _changed_somewhere()  # validated before any use: nothing to run again
        if kwargs.get("forward_only"):
            return forward_backward(**kwargs)
    _CALLS[0] += 1
    call = _CALLS[0]
    for listener in _LISTENERS:
        listener("start")
    step_func = _observed(kwargs["forward_step_func"], call)
    if not late:
        return forward_backward(**{**kwargs, "forward_step_func": step_func})
    replay = _Replay(kwargs.get("data_iterator"))
    rng = _RandomState()  # dropout: the run again draws the same masks
    result = forward_backward(**{**kwargs, "forward_step_func": step_func, "data_iterator": replay.recording()})
    validate_pending()
    if not _changed_somewhere():
        return result
    # The iteration ran on weights that validation has undone on some stage: every stage runs it again
    # as train_step prepared it (zeroed gradient buffers and optimizer gradients), on the same data.
    EVENTS.append(("rerun", call))
    for listener in _LISTENERS:
        listener("discard")
    model = kwargs["model"]
    for chunk in model if isinstance(model, list) else [model]:
        chunk.zero_grad_buffer()
    for optimizer in _ACTIVE:
        optimizer.zero_grad()
        optimizer.stats.reruns += 1
    rng.restore()
    return forward_backward(
        **{
            **kwargs,
            "forward_step_func": _observed(kwargs["forward_step_func"], call),
            "data_iterator": replay.replaying(),
        }
    )


def patch_megatron(patcher: Patcher) -> None:
    import importlib

    optimizer_module = importlib.import_module("megatron.core.optimizer")
    original = optimizer_module.get_megatron_optimizer

    def get_megatron_optimizer(config: Any, model_chunks: Any, *args: Any, **kwargs: Any) -> Any:
        from ..runtime.post_validation import wrap

        optimizer = original(config, model_chunks, *args, **kwargs)
        params = [p for chunk in model_chunks for p in chunk.parameters()]
        wrapped = wrap(optimizer, params, bool(config.use_distributed_optimizer))
        wrapped.observer = lambda event: EVENTS.append((event, 0))
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
    training = importlib.import_module("megatron.training.training")
    original_train = training.train

    def train(*args: Any, **kwargs: Any) -> Any:
        result = original_train(*args, **kwargs)
        validate_pending()  # the last step: the model pretrain() leaves is validated
        return result

    patcher.replace("megatron.training.training", "train", train)
    _patch_post_step_reductions(patcher, training)


def _stage_local(group: Any) -> Any:
    """The group to reduce train_step's / training_log's statistics over instead of the model-parallel
    group, or None to keep megatron's: the tensor-parallel group (this stage) when every step's
    ``update_successful`` is final (:meth:`~..runtime.post_validation.PostValidatedOptimizer.success_is_final`).
    The logged grad norm and zero count come from the last rank, whose state is complete."""
    from megatron.core import parallel_state as ps

    if not _ACTIVE or not all(optimizer.success_is_final() for optimizer in _ACTIVE):
        return None
    if group is not None and group is not ps.get_model_parallel_group():
        return None
    _STAGE_LOCAL[0] += 1
    return ps.get_tensor_model_parallel_group()


def _patch_post_step_reductions(patcher: Patcher, training: Any) -> None:
    """train_step all-reduces update_successful, grad norm and zero count over the model-parallel group
    (TP x PP) after the step, training_log the learning rate: a wait for every stage's step each iteration.
    Over the stage only when that gives the same values (see :func:`_stage_local`)."""
    original_and = training.logical_and_across_model_parallel_group
    original_max = training.reduce_max_stat_across_model_parallel_group

    def logical_and_across_model_parallel_group(value: bool, group: Any = None) -> bool:
        return original_and(value, group=_stage_local(group) or group)

    def reduce_max_stat_across_model_parallel_group(stat: Any, group: Any = None) -> Any:
        return original_max(stat, group=_stage_local(group) or group)

    patcher.replace(
        "megatron.training.training", "logical_and_across_model_parallel_group", logical_and_across_model_parallel_group
    )
    patcher.replace(
        "megatron.training.training",
        "reduce_max_stat_across_model_parallel_group",
        reduce_max_stat_across_model_parallel_group,
    )


def forget() -> None:
    """install()'s uninstall: drop the wrapped optimizers (their validations are the caller's)."""
    _ACTIVE.clear()
    _LISTENERS.clear()
