"""A checkpoint that cannot be loaded must stop the run with a non-zero status and one line.

megatron-core 0.19.2's ``_load_base_checkpoint`` (``megatron/training/checkpointing.py``) prints
"could not load the checkpoint" and calls ``sys.exit()`` — status 0, so a job scheduler sees a
successful run that trained nothing. :func:`fail_loudly_on_bad_checkpoint` wraps it so that such
an exit becomes status 1 with one line naming the directory. A damaged file (a truncated
``torch_dist`` shard: ``EOFError``; a corrupted ``metadata.json``: ``JSONDecodeError``; a torch file
that is not one: ``UnpicklingError``) raised megatron's bare exception, which names neither the file
nor the cause: it becomes one line naming both (:func:`describe_load_error`), and status 1.
"""

from __future__ import annotations

import functools
import json
import os
import pickle
import sys
from pathlib import Path
from typing import Any

from ._patching import replace_everywhere

MODULE = "megatron.training.checkpointing"
FUNCTION = "_load_base_checkpoint"


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
            return original(load_dir, *args, **kwargs)
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

    load_base_checkpoint._megatron_pp_ext = True  # type: ignore[attr-defined]
    replace_everywhere(MODULE, FUNCTION, load_base_checkpoint)


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
