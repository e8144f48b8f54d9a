"""The size rules of the package (docs/contributing.md): no module over ``MODULE_LIMIT`` lines, and no function
over ``FUNCTION_LIMIT`` lines unless its docstring states why in a sentence starting with ``REASON_MARKER``.

A function's length counts its lines from ``def`` to its last statement (docstring and nested functions
included), as ``scripts/long_functions.py`` lists them.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_pp_ext"
FUNCTION_LIMIT = 80
MODULE_LIMIT = 700
REASON_MARKER = "Long because"


def long_functions(source: str, limit: int = FUNCTION_LIMIT) -> list[tuple[str, int]]:
    """``(qualified name, lines)`` of each function in ``source`` over ``limit`` lines with no stated reason."""
    out: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                assert child.end_lineno is not None
                lines = child.end_lineno - child.lineno + 1
                if lines > limit and REASON_MARKER not in (ast.get_docstring(child) or ""):
                    out.append((f"{prefix}{child.name}", lines))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(source), "")
    return out


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_long_function_without_a_stated_reason() -> None:
    over = {
        f"{path.relative_to(PACKAGE.parent)}:{name}": lines
        for path in _modules()
        for name, lines in long_functions(path.read_text())
    }
    found = [f"{name} ({lines} lines)" for name, lines in sorted(over.items())]
    assert not found, (
        f"functions over {FUNCTION_LIMIT} lines: split them into named steps, or say in the docstring "
        f"why the long body is the clearest form ('{REASON_MARKER} ...'):\n" + "\n".join(found)
    )


def test_no_module_over_the_limit() -> None:
    found = [
        f"{path.relative_to(PACKAGE.parent)} ({n} lines)"
        for path in _modules()
        if (n := len(path.read_text().splitlines())) > MODULE_LIMIT
    ]
    assert not found, f"modules over {MODULE_LIMIT} lines (split them by job):\n" + "\n".join(found)


def test_the_rule_sees_a_long_function_and_its_reason() -> None:
    """The checker itself: a long body is caught, the marker in its docstring excuses it, a short one passes."""
    body = "".join(f"    x{i} = {i}\n" for i in range(FUNCTION_LIMIT))
    bare = f"def f():\n{body}"
    excused = f'def f():\n    """Does it. {REASON_MARKER} it is a table."""\n{body}'
    nested = f"class C:\n    def g(self):\n        def f():\n{body.replace('    ', '            ')}"
    assert long_functions(bare) == [("f", FUNCTION_LIMIT + 1)]
    assert long_functions(excused) == []
    assert [name for name, _ in long_functions(nested)] == ["C.g", "C.g.f"]
    assert long_functions("def f():\n    return 1\n") == []
