"""Import layering: no import cycle at module load time anywhere in the package; with function-level
imports included, exactly one circle (the schedule registry's self-registration: ``registry`` loads
``generators``, whose modules register with it), none between ``cli`` and ``runtime`` or between
``planner.memory`` and ``planner.models``, and no import from a pure layer up to a later one. The graph
is read statically from the source (``ast``): pure and fast; imports under ``if TYPE_CHECKING:`` never
run and are left out."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_pp_ext"


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module, top_level: bool) -> list[ast.Import | ast.ImportFrom]:
    """Import statements that run: at load time only (``top_level``) or anywhere."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(nodes: list[ast.stmt]) -> None:
        for node in nodes:
            if isinstance(node, ast.Import | ast.ImportFrom):
                found.append(node)
            elif isinstance(node, ast.If) and _is_type_checking(node):
                visit(node.orelse)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                if not top_level:
                    visit(node.body)
            elif isinstance(node, ast.ClassDef | ast.If | ast.Try | ast.With | ast.For | ast.While):
                for field in ("body", "orelse", "finalbody", "handlers"):
                    block = getattr(node, field, [])
                    visit([s for h in block for s in h.body] if field == "handlers" else block)

    visit(tree.body)
    return found


def import_graph(top_level: bool) -> dict[str, set[str]]:
    """Module -> the package modules it imports (``from pkg import name`` counts ``pkg.name`` when that
    is a module, else ``pkg``)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str] = set()
        for node in _imports(ast.parse(path.read_text()), top_level):
            if isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in modules)
                continue
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                full = f"{source}.{alias.name}"
                if full in modules:
                    deps.add(full)
                elif source in modules:
                    deps.add(source)
        deps.discard(name)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    return out


def test_the_graph_sees_the_package() -> None:
    graph = import_graph(top_level=False)
    assert "megatron_pp_ext.schedules.engine" in graph["megatron_pp_ext.schedules.generators.zbv"]
    assert (
        "megatron_pp_ext.verification.verify_cli" in graph["megatron_pp_ext.cli.cmd_verify"]
    )  # a function-level import
    assert (
        "megatron_pp_ext.verification.verify_cli" not in import_graph(top_level=True)["megatron_pp_ext.cli.cmd_verify"]
    )
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_cycle_at_load_time() -> None:
    assert cycles(import_graph(top_level=True)) == []


REGISTRY = ("megatron_pp_ext.schedules.registry", "megatron_pp_ext.schedules.generators")


def _is_registry(component: list[str]) -> bool:
    """The schedules' self-registration: ``registry`` loads ``generators``, whose modules register with it."""
    return all(any(m == r or m.startswith(r + ".") for r in REGISTRY) for m in component)


def test_one_circle_in_the_whole_package() -> None:
    """Function-level imports included, the only circle is the registry's self-registration."""
    found = cycles(import_graph(top_level=False))
    registry = [c for c in found if _is_registry(c)]
    assert len(registry) <= 1, registry
    others = [c for c in found if not _is_registry(c)]
    assert not others, "import circles besides the registry's:\n" + "\n".join(" <-> ".join(c) for c in others)


@pytest.mark.parametrize(
    ("one", "other"),
    [
        ("megatron_pp_ext.cli", "megatron_pp_ext.runtime"),
        ("megatron_pp_ext.cli", "megatron_pp_ext.verification"),
        ("megatron_pp_ext.runtime", "megatron_pp_ext.verification"),
        ("megatron_pp_ext.planner.memory", "megatron_pp_ext.planner.models"),
    ],
)
def test_no_cycle_between(one: str, other: str) -> None:
    """Not even through a function-level import: one layer imports the other, never both ways."""
    for component in cycles(import_graph(top_level=False)):
        mine = [m for m in component if m == one or m.startswith(one + ".")]
        theirs = [m for m in component if m == other or m.startswith(other + ".")]
        assert not (mine and theirs), f"import cycle through {mine} and {theirs}: {component}"


@pytest.mark.parametrize(
    "module",
    [
        "megatron_pp_ext.cli",
        "megatron_pp_ext.schedule_args",
        "megatron_pp_ext.verification.verify_cli",
        "megatron_pp_ext.planner.memory",
        "megatron_pp_ext.planner.models",
    ],
)
def test_imports_first_in_a_fresh_interpreter(module: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-c", f"import {module}"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


LAYERS = ("schedules", "analysis", "planner")  # each imports only the ones before it (and the leaf modules)


@pytest.mark.parametrize("layer", LAYERS)
def test_no_upward_import(layer: str) -> None:
    """Function-level imports included: a pure layer never imports a later one, ``cli`` or the torch side."""
    above = [*LAYERS[LAYERS.index(layer) + 1 :], "cli", "runtime", "integration", "verification"]
    prefix = f"megatron_pp_ext.{layer}"
    bad = sorted(
        f"{module} -> {dep}"
        for module, deps in import_graph(top_level=False).items()
        if module == prefix or module.startswith(prefix + ".")
        for dep in deps
        if any(dep == f"megatron_pp_ext.{up}" or dep.startswith(f"megatron_pp_ext.{up}.") for up in above)
    )
    assert not bad, "\n".join(bad)


def test_nothing_imports_the_cli() -> None:
    bad = sorted(
        f"{module} -> {dep}"
        for module, deps in import_graph(top_level=False).items()
        if not module.startswith("megatron_pp_ext.cli")
        for dep in deps
        if dep.startswith("megatron_pp_ext.cli")
    )
    assert not bad, "\n".join(bad)
