"""Checkpoints load exactly into the model the run built, or the run stops with one line and status 1.

megatron-core 0.19.2 (``megatron/training/checkpointing.py``) ends three kinds of failed loads in a
run that looks successful:

* **Unreadable checkpoint.** ``_load_base_checkpoint`` prints "could not load the checkpoint" and
  calls ``sys.exit()``: status 0, so a job scheduler sees a successful run that trained nothing.
  :func:`fail_loudly_on_bad_checkpoint` turns that exit into status 1 with one line naming the
  directory.
* **A ``--ckpt-format torch`` checkpoint saved under another placement.** Such a checkpoint holds each
  rank's chunks with chunk-local layer numbers (:mod:`.checkpoint_layout`); megatron loads them by
  those names into whatever chunks this run has, skips what it does not find, and prints
  ``successfully loaded checkpoint``: saved under ``1f1b`` and loaded under ``v-half``, nothing is
  loaded at all. :func:`check_torch_checkpoint_layouts` makes every torch-format save record the
  layer layout of all ranks (:data:`~.checkpoint_layout.RECORD_KEY`, plain ints and bools) and every
  torch-format load compare it with the model being loaded into. When they differ:

  - with ``--no-load-optim`` (or ``--finetune``), the weights of every saved rank are moved onto this
    run's chunks (:mod:`.checkpoint_mapping`: the same tensors, checked key for key against what each
    chunk holds), and one line says so;
  - otherwise the run stops before training, with one line naming both layouts and the ways that
    work: the optimizer state of this format is a per-rank list of parameters that cannot move.

  Every rank holds the same record and computes the same table, and the one per-rank step (the
  mapping) is followed by an all-gather of its outcome, so all ranks go on or stop together.
* **A damaged file** (a truncated ``torch_dist`` shard: ``EOFError``; a corrupted ``metadata.json``:
  ``JSONDecodeError``; a torch file that is not one: ``UnpicklingError``) raised megatron's bare
  exception, which names neither the file nor the cause: it becomes one line naming both
  (:func:`describe_load_error`), and status 1.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import re
import sys
from pathlib import Path
from typing import Any

from ._patching import replace_everywhere
from .checkpoint_layout import (
    RECORD_KEY,
    as_record,
    describe,
    mismatch,
    saved_table,
    schedule_label,
    table_of_layouts,
)
from .checkpoint_mapping import MappingError, map_chunks

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
        except DAMAGED as exc:
            print(f"megatron_pp_ext: error: {describe_load_error(exc, load_dir)}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
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
    """A torch-format checkpoint whose chunks are not this run's: move its weights onto this run's chunks
    (with --no-load-optim / --finetune), else stop every rank with one line from rank 0."""
    from megatron.training import get_args
    from megatron.training.checkpointing import CheckpointType

    state_dict, _, release, ckpt_type = result
    if state_dict is None or ckpt_type != CheckpointType.LEGACY:
        return
    args = get_args()
    current = current_table(model_chunks)
    why = mismatch(state_dict, current, args)
    if why is None:
        return
    saving, here = schedule_label(state_dict.get("args")), _label(args)
    head = (
        f"--load {load_dir}: this --ckpt-format torch checkpoint (saved under {saving}) stores each rank's chunks "
        f"with chunk-local layer numbers and does not fit the chunks of this run ({here}): {why}"
    )
    saved = saved_table(state_dict)
    if saved is None or len(saved) != len(current):
        _stop(
            f"{head}; megatron would load nothing or the wrong layers. Load it under the schedule that saved it, "
            "or save checkpoints with --ckpt-format torch_dist, which moves between schedules"
        )
    if not (getattr(args, "no_load_optim", False) or getattr(args, "finetune", False)):
        _stop(
            f"{head}. Its weights can move onto this run's chunks, its optimizer state cannot (a per-rank list of "
            "parameters): add --no-load-optim to load the weights only, load it under a schedule with the same "
            "placement, or save checkpoints with --ckpt-format torch_dist, which moves between schedules"
        )
    mapped, failure = None, None
    try:
        mapped = map_chunks(
            _saved_chunks(load_dir, release, state_dict, saved), saved, current, _pp_rank(), _expected(model_chunks)
        )
    except (MappingError, OSError, RuntimeError, KeyError, ValueError) as exc:
        failure = f"{type(exc).__name__}: {exc}"
    failures = _gather(failure)
    if any(failures):
        rank, reason = next((r, f) for r, f in enumerate(failures) if f)
        _stop(f"{head}; its weights cannot move onto this run's chunks (rank {rank}: {reason})")
    assert mapped is not None
    for key in [k for k in state_dict if k == "model" or re.fullmatch(r"model\d+", k)]:
        del state_dict[key]
    if len(mapped) == 1:
        state_dict["model"] = mapped[0]
    else:
        state_dict.update({f"model{i}": chunk for i, chunk in enumerate(mapped)})
    if _global_rank() == 0:
        print(
            f"megatron_pp_ext: moved the weights of the --ckpt-format torch checkpoint {load_dir} (saved under "
            f"{saving}: {describe(saved)}) onto this run's chunks ({here}: {describe(current)}); optimizer state "
            "not loaded",
            flush=True,
        )


# The installed plugin schedule's label, set by the checkpoint feature while install() is in effect
# (features/checkpoint_safety.py), so that this module need not import install.
_INSTALLED_LABEL: list[str] = []


def set_installed_label(label: str | None) -> None:
    """The label of the schedule install() put in place (None: megatron's own)."""
    _INSTALLED_LABEL[:] = [] if label is None else [label]


def _label(args: Any) -> str:
    return _INSTALLED_LABEL[0] if _INSTALLED_LABEL else schedule_label(args)


def _global_rank() -> int:
    import torch

    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _pp_rank() -> int:
    from megatron.core import parallel_state

    return int(parallel_state.get_pipeline_model_parallel_rank())


def _saved_chunks(load_dir: Any, release: bool, state_dict: dict[str, Any], saved: Any) -> list[list[Any]]:
    """Every saved pipeline rank's chunk state dicts (this rank's from ``state_dict``, the others read mmapped)."""
    import torch
    from megatron.training import checkpointing

    chunks = []
    for rank, layouts in enumerate(saved):
        if rank == _pp_rank():
            source = state_dict
        else:
            name = checkpointing.get_checkpoint_name(
                load_dir, checkpointing.get_loaded_iteration(), release, pipeline_rank=rank
            )
            source = torch.load(name, map_location="cpu", mmap=True)
        keys = ["model"] if "model" in source else [f"model{i}" for i in range(len(layouts))]
        chunks.append([source[key] for key in keys])
    return chunks


def _expected(model_chunks: Any) -> list[set[str]]:
    """The keys each of this run's chunks saves (and so loads) under megatron's torch format."""
    chunks = model_chunks if isinstance(model_chunks, list) else [model_chunks]
    return [set(chunk.state_dict_for_save_checkpoint()) for chunk in chunks]


def _gather(failure: str | None) -> list[str | None]:
    """Every rank's failure (None: none), so that all ranks stop together or none does."""
    import torch

    if not torch.distributed.is_initialized():
        return [failure]
    out: list[str | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(out, failure)
    return out


def _stop(line: str) -> None:
    """One line from rank 0, then every rank out (each reached the same verdict; no gloo teardown at exit).

    The ranks leave only after rank 0 has written the line (a barrier): torchrun stops the other ranks as soon
    as one exits, which could otherwise kill rank 0 before it writes."""
    import torch

    if _global_rank() == 0:
        sys.stderr.write(f"megatron_pp_ext: error: {line}\n")
        sys.stderr.flush()
    sys.stdout.flush()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    os._exit(1)


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


# What a damaged checkpoint file raises from megatron's and torch's readers.
DAMAGED = (EOFError, json.JSONDecodeError, pickle.UnpicklingError, UnicodeDecodeError)


def describe_load_error(exc: BaseException, load_dir: Any) -> str:
    """One line: the damaged file (the innermost frame of the traceback holding a path to an existing
    file under ``load_dir``; else the directory) and the cause."""
    causes = {
        EOFError: "the file ends early (truncated: an interrupted save or copy?)",
        json.JSONDecodeError: "not valid JSON",
        pickle.UnpicklingError: "not a torch file",
        UnicodeDecodeError: "not text",
    }
    cause = next(text for kind, text in causes.items() if isinstance(exc, kind))
    if "truncated" in str(exc):  # pickle's own word for a file that ends early
        cause = causes[EOFError]
    detail = str(exc).splitlines()[0][:120] if str(exc) else type(exc).__name__
    where = damaged_file(exc, load_dir)
    return (
        f"cannot load the checkpoint from {load_dir}: {where or 'a file of it'}: {cause} "
        f"({type(exc).__name__}: {detail})"
    )


def damaged_file(exc: BaseException, load_dir: Any) -> str | None:
    """The file under ``load_dir`` the failing reader had open, from the traceback's local variables."""
    try:
        root = Path(os.fspath(load_dir)).resolve()
    except TypeError:
        return None
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):  # innermost first: the reader, then its callers
        for value in list(frame.f_locals.values()):
            name = getattr(value, "name", value)  # an open file object names its path
            if not isinstance(name, str | os.PathLike) or isinstance(name, bool):
                continue
            try:
                path = Path(os.fspath(name)).resolve()
            except (TypeError, ValueError, OSError):
                continue
            if path.is_file() and (path == root or root in path.parents):
                return str(path)
    return None
