"""Every module imports alone, and the flag modules never import the planner (the pure layers' import
direction and the cycles: test_import_cycles.py).

* Each module of the package is imported on its own in a fresh set of ``megatron_pp_ext`` modules (one
  subprocess; torch and megatron stay loaded between modules, our own modules do not), so an import cycle
  between two of our modules, which only bites when one of them is imported first, fails here.
* The flag modules (``integration/arguments.py``, ``config.py``, ``flags.py``,
  ``features/chunk_fsdp.py``) do not import the planner: the auto decision runs from the install path
  (``integration/auto_schedule.py``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.import_graph import import_graph

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_pp_ext"

IMPORT_EACH = r"""
import importlib, sys, traceback
from megatron_pp_ext.integration import cpu  # the CPU shim every megatron import needs first
cpu.enable_cpu_mode()
failed = []
for name in sys.argv[1:]:
    for mod in [m for m in sys.modules if m.startswith("megatron_pp_ext") and m != "megatron_pp_ext.integration.cpu"]:
        del sys.modules[mod]
    try:
        importlib.import_module(name)
    except Exception:
        failed.append(name + ": " + traceback.format_exc().strip().splitlines()[-1])
print("\n".join(failed))
sys.exit(1 if failed else 0)
"""


def _modules() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


@pytest.mark.slow
def test_every_module_imports_alone() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", IMPORT_EACH, *_modules()],
        capture_output=True,
        text=True,
        cwd=PACKAGE.parent,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


@pytest.mark.parametrize("module", ["arguments", "config", "flags", "features.chunk_fsdp"])
def test_flag_validation_does_not_import_the_planner(module: str) -> None:
    deps = import_graph(top_level=False)[f"megatron_pp_ext.integration.{module}"]
    bad = sorted(m for m in deps if m.startswith("megatron_pp_ext.planner"))
    assert not bad, bad
