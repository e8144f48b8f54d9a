"""The package's longest modules and its functions over a line limit (default 80), longest first.

Usage::

    python scripts/long_functions.py [--limit 80] [--modules 10]

A function's length counts its lines from ``def`` to its last statement (decorators and docstring
included); nested functions are counted within their parent and listed on their own too.
"""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_pp_ext"


def functions(path: Path) -> list[tuple[int, str]]:
    """``(lines, qualified name)`` of every function in ``path``."""
    tree = ast.parse(path.read_text())
    out: list[tuple[int, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                assert child.end_lineno is not None
                out.append((child.end_lineno - child.lineno + 1, f"{prefix}{child.name}"))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")

    visit(tree, "")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=80, help="list functions longer than this (lines)")
    parser.add_argument("--modules", type=int, default=10, help="how many of the longest modules to list")
    options = parser.parse_args()
    files = sorted(PACKAGE.rglob("*.py"))
    sizes = sorted(((len(p.read_text().splitlines()), p) for p in files), reverse=True)
    print(f"longest modules (of {len(files)}):")
    for lines, path in sizes[: options.modules]:
        print(f"{lines:6d}  {path.relative_to(PACKAGE.parent)}")
    long = sorted(
        ((lines, f"{path.relative_to(PACKAGE.parent)}:{name}") for path in files for lines, name in functions(path)),
        reverse=True,
    )
    over = [item for item in long if item[0] > options.limit]
    print(f"functions over {options.limit} lines: {len(over)}")
    for lines, name in over:
        print(f"{lines:6d}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
