"""A checkpoint that cannot be loaded must stop the run with a non-zero status.

megatron-core 0.19.2's ``_load_base_checkpoint`` (``megatron/training/checkpointing.py``) prints
"could not load the checkpoint" and calls ``sys.exit()`` — status 0, so a job scheduler sees a
successful run that trained nothing. :func:`fail_loudly_on_bad_checkpoint` wraps it so that such
an exit becomes status 1 with one line naming the directory.
"""

from __future__ import annotations

import functools
import sys
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
