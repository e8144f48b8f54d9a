"""Import direction and cycles: every module imports alone, and the pure layers never reach up.

* Each module of the package is imported on its own in a fresh set of ``megatron_pp_ext`` modules (one
  subprocess; torch and megatron stay loaded between modules, our own modules do not), so an import cycle
  between two of our modules, which only bites when one of them is imported first, fails here.
* ``schedules``, ``analysis`` and ``planner`` (pure planning) import nothing from ``runtime`` or ``megatron``,
  not even lazily inside a function; the flag modules (``integration/arguments.py``, ``config.py``, ``flags.py``,
  ``fsdp_flags.py``) do not import the planner: the auto decision runs from the install path
  (``integration/auto_schedule.py``).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_pp_ext"
PURE = ("schedules", "analysis", "planner")
UP = ("runtime", "integration")

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


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, absolute module)`` of every import in ``path``, module level or inside a function."""
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
    return found


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


@pytest.mark.parametrize("layer", PURE)
def test_pure_layers_do_not_import_runtime_or_megatron(layer: str) -> None:
    bad = [
        f"{path.relative_to(PACKAGE.parent)}:{line}: {module}"
        for path in sorted((PACKAGE / layer).rglob("*.py"))
        for line, module in _imports(path)
        if any(module == f"megatron_pp_ext.{up}" or module.startswith(f"megatron_pp_ext.{up}.") for up in UP)
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module", ["arguments.py", "config.py", "flags.py", "fsdp_flags.py"])
def test_flag_validation_does_not_import_the_planner(module: str) -> None:
    bad = [m for _, m in _imports(PACKAGE / "integration" / module) if m.startswith("megatron_pp_ext.planner")]
    assert not bad, bad
