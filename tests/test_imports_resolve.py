"""Every ``from megatron_pp_ext... import name`` in the package, the tests, the scripts and the benchmarks names a
module or a name that exists, function-level imports included (those run only when their path does: a rename
that leaves one behind fails here instead of in a user's run). Read with :mod:`ast`, resolved as
:mod:`tests.doc_references` resolves docstring references."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.doc_references import PACKAGE, ROOT, Resolver, _absolute, module_name


def _importing_files() -> list[Path]:
    folders = (PACKAGE, "tests", "scripts", "benchmarks")
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def _source_module(path: Path, node: ast.ImportFrom) -> str | None:
    """The module a ``from`` import reads (relative ones resolved as docstring references are)."""
    if not node.level:
        return node.module
    if not path.is_relative_to(ROOT / PACKAGE):
        return None
    return _absolute(module_name(path), path.name == "__init__.py", node.level, node.module)


# A ``from ... import ...`` statement, one line or parenthesised: parsing only these is ten times faster than
# parsing whole files (an example in a docstring is checked too, which it should pass as well).
FROM_IMPORT = re.compile(r"^[ \t]*(from[ \t]+\.*[\w.]*[ \t]+import[ \t]+(?:\([^)]*\)|[^\n]*))", re.M)


def _from_imports(text: str) -> list[tuple[int, ast.ImportFrom]]:
    found = []
    for match in FROM_IMPORT.finditer(text):
        try:
            node = ast.parse(re.sub(r"#[^\n]*", "", match.group(1)).strip()).body[0]
        except SyntaxError:  # prose that happens to read like an import
            continue
        if isinstance(node, ast.ImportFrom):
            found.append((text.count("\n", 0, match.start()) + 1, node))
    return found


def unresolved_imports(resolver: Resolver) -> list[str]:
    missing = []
    for path in _importing_files():
        for lineno, node in _from_imports(path.read_text(encoding="utf-8")):
            module = _source_module(path, node)
            if module is None or not module.startswith(PACKAGE):
                continue
            for alias in node.names:
                if alias.name != "*" and not resolver.exists(f"{module}.{alias.name}"):
                    missing.append(f"{path.relative_to(ROOT)}:{lineno}: from {module} import {alias.name}")
    return missing


def test_every_import_of_the_package_resolves() -> None:
    missing = unresolved_imports(Resolver())
    assert not missing, "imports of names that do not exist:\n" + "\n".join(missing)
