"""The package's import graph, read statically from the source (``ast``): pure and fast. Imports under
``if TYPE_CHECKING:`` never run and are left out. Used by ``test_import_cycles.py`` and ``test_layering.py``."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

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
    is a module, else ``pkg``). Read once per test session (the sources do not change during it); each
    caller gets its own copy."""
    return {name: set(deps) for name, deps in _graph(top_level).items()}


@functools.lru_cache(maxsize=2)
def _graph(top_level: bool) -> dict[str, set[str]]:
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
