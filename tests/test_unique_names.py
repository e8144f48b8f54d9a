"""No two modules of the package share a basename and no two classes share a name, so that a name (in a
traceback, a docstring's ``:class:`` reference, a search) points at one thing. ``__init__.py`` and
``__main__.py`` are every package's. Read statically (``ast``): pure and fast.

``ALLOWED``: name clashes kept on purpose, each with its reason (none today; add one only with a reason
that renaming cannot serve)."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_pp_ext"
PACKAGE_FILES = ("__init__.py", "__main__.py")
ALLOWED: dict[str, str] = {}


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def duplicates(named: dict[str, list[str]]) -> dict[str, list[str]]:
    return {name: places for name, places in named.items() if len(places) > 1 and name not in ALLOWED}


def module_basenames() -> dict[str, list[str]]:
    out: dict[str, list[str]] = defaultdict(list)
    for path in _modules():
        if path.name not in PACKAGE_FILES:
            out[path.name].append(str(path.relative_to(PACKAGE.parent)))
    return out


def class_names() -> dict[str, list[str]]:
    """Every class defined anywhere in the package (nested ones too), by name."""
    out: dict[str, list[str]] = defaultdict(list)
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                out[node.name].append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    return out


def test_the_scan_finds_clashes() -> None:
    assert duplicates({"a.py": ["x/a.py", "y/a.py"], "b.py": ["x/b.py"]}) == {"a.py": ["x/a.py", "y/a.py"]}
    assert "PipelineConfig" in class_names() and "install.py" in module_basenames()


def test_no_two_modules_share_a_basename() -> None:
    clashes = duplicates(module_basenames())
    assert not clashes, "modules sharing a basename (rename one to say what it holds):\n" + "\n".join(
        f"  {name}: {', '.join(places)}" for name, places in sorted(clashes.items())
    )


def test_no_two_classes_share_a_name() -> None:
    clashes = duplicates(class_names())
    assert not clashes, "classes sharing a name (rename one to say what it holds):\n" + "\n".join(
        f"  {name}: {', '.join(places)}" for name, places in sorted(clashes.items())
    )
