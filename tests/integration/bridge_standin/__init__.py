"""Stand-ins for the two Megatron-Bridge modules that run megatron's pipeline schedules (megatron-bridge 0.6.2,
``src/megatron/bridge/training/train.py`` and ``src/megatron/bridge/training/eval.py``): the same imports of
megatron's schedule functions (by name, from the same megatron modules) and the same calls, keyword for keyword,
reduced to what touches the schedule. Loaded under Bridge's module names (:func:`load`) so that
:func:`megatron_pp_ext.install` meets them where it meets Bridge's own modules; nothing of Bridge is imported."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).parent
#: stand-in file -> the Bridge module it mirrors
MIRRORS = {"train.py": "megatron.bridge.training.train", "eval.py": "megatron.bridge.training.eval"}


def load(file: str, modules: dict[str, ModuleType] | None = None) -> ModuleType:
    """Import the stand-in ``file`` as its Bridge module (registered in ``modules``, default ``sys.modules``)."""
    registry = sys.modules if modules is None else modules
    name = MIRRORS[file]
    spec = importlib.util.spec_from_file_location(name, HERE / file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    registry[name] = module
    spec.loader.exec_module(module)
    return module
