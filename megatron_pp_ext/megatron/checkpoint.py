"""Checkpoints load into the model the run built, or the run stops with one line and a non-zero status.

megatron-core 0.19.2 (``megatron/training/checkpointing.py``) ends two kinds of failed loads in a
run that looks successful:

* **Unreadable checkpoint.** ``_load_base_checkpoint`` prints "could not load the checkpoint" and
  calls ``sys.exit()``: status 0, so a job scheduler sees a successful run that trained nothing.
  :func:`fail_loudly_on_bad_checkpoint` turns that exit into status 1 with one line naming the
  directory.
* **A ``--ckpt-format torch`` checkpoint saved under another placement.** Such a checkpoint holds each
  rank's chunks with chunk-local layer numbers (:mod:`.checkpoint_layout`); megatron loads them by
  those names into whatever chunks this run has, skips what it does not find, and prints
  ``successfully loaded checkpoint``. Saved under ``1f1b`` and loaded under ``v-half`` nothing is
  loaded at all. :func:`check_torch_checkpoint_layouts` makes every torch-format save record the
  layer layout of all ranks (:data:`~.checkpoint_layout.RECORD_KEY`, plain ints and bools) and every
  torch-format load compare it with the model being loaded into; a difference stops the run before
  training, with one line (rank 0) naming both layouts and the format that moves between schedules.
  Every rank holds the same record and computes the same table, so all ranks stop together.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

from ._patching import replace_everywhere
from .checkpoint_layout import RECORD_KEY, as_record, mismatch, schedule_label, table_of_layouts

MODULE = "megatron.training.checkpointing"
FUNCTION = "_load_base_checkpoint"
_LOADING_INTO: list[Any] = []  # the model chunks load_checkpoint is loading into (while it runs)


def fail_loudly_on_bad_checkpoint() -> None:
    """Turn megatron's status-0 exit on a checkpoint load failure into status 1 (idempotent)."""
    import importlib

    module = importlib.import_module(MODULE)
    original = getattr(module, FUNCTION)
    if getattr(original, "_megatron_pp_ext", False):
        return

    @functools.wraps(original)
    def load_base_checkpoint(load_dir: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            result = original(load_dir, *args, **kwargs)
        except SystemExit as exc:
            if exc.code in (None, 0):
                print(
                    f"megatron_pp_ext: error: could not load the checkpoint from {load_dir} (megatron's reason is "
                    "printed above); exiting with status 1",
                    file=sys.stderr,
                    flush=True,
                )
                raise SystemExit(1) from None
            raise
        rank0 = kwargs.get("rank0", args[1] if len(args) > 1 else False)
        if _LOADING_INTO and not rank0:
            _check_loaded(load_dir, result, _LOADING_INTO[-1])
        return result

    load_base_checkpoint._megatron_pp_ext = True  # type: ignore[attr-defined]
    replace_everywhere(MODULE, FUNCTION, load_base_checkpoint)


def current_table(model_chunks: Any) -> tuple[tuple[tuple[int, int, bool, bool], ...], ...]:
    """The layout table of the model megatron built in this run (every pipeline rank's chunks)."""
    from megatron.core.utils import get_attr_wrapped_model

    from .layout import megatron_chunk_layouts

    chunks = model_chunks if isinstance(model_chunks, list) else [model_chunks]
    config = get_attr_wrapped_model(chunks[0], "config")
    p = int(config.pipeline_model_parallel_size or 1)
    return table_of_layouts([megatron_chunk_layouts(config, r) for r in range(p)])


def _check_loaded(load_dir: Any, result: Any, model_chunks: Any) -> None:
    """Stop every rank (one line from rank 0) when a torch-format checkpoint's chunks are not this run's."""
    import torch
    from megatron.training import get_args
    from megatron.training.checkpointing import CheckpointType

    state_dict, _, _, ckpt_type = result
    if state_dict is None or ckpt_type != CheckpointType.LEGACY:
        return
    args = get_args()
    why = mismatch(state_dict, current_table(model_chunks), args)
    if why is None:
        return
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        from .install import installed

        config = installed()
        here = config.label if config is not None else schedule_label(args)
        sys.stderr.write(
            f"megatron_pp_ext: error: --load {load_dir}: this --ckpt-format torch checkpoint (saved under "
            f"{schedule_label(state_dict.get('args'))}) stores each rank's chunks with chunk-local layer numbers "
            f"and does not fit the chunks of this run ({here}): {why}; megatron would load nothing or the wrong "
            "layers. Load it under a schedule with the same placement, or save checkpoints with --ckpt-format "
            "torch_dist, which moves between schedules\n"
        )
        sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)  # every rank decides the same; no collective to wait for, no gloo teardown at exit


def check_torch_checkpoint_layouts() -> None:
    """Record the layer layout in every torch-format save and check it on every load (idempotent)."""
    import importlib

    fail_loudly_on_bad_checkpoint()  # the load check lives in its wrapper of _load_base_checkpoint
    module = importlib.import_module(MODULE)
    if getattr(module.load_checkpoint, "_megatron_pp_ext", False):
        return
    load_original, generate_original = module.load_checkpoint, module.generate_state_dict

    @functools.wraps(load_original)
    def load_checkpoint(ddp_model: Any, *args: Any, **kwargs: Any) -> Any:
        _LOADING_INTO.append(ddp_model)
        try:
            return load_original(ddp_model, *args, **kwargs)
        finally:
            _LOADING_INTO.pop()

    @functools.wraps(generate_original)
    def generate_state_dict(args: Any, model: Any, *rest: Any, **kwargs: Any) -> Any:
        state_dict = generate_original(args, model, *rest, **kwargs)
        if getattr(args, "ckpt_format", None) == "torch":
            state_dict[RECORD_KEY] = as_record(current_table(model))
        return state_dict

    for function in (load_checkpoint, generate_state_dict):
        function._megatron_pp_ext = True  # type: ignore[attr-defined]
    replace_everywhere(MODULE, "load_checkpoint", load_checkpoint)
    replace_everywhere(MODULE, "generate_state_dict", generate_state_dict)
