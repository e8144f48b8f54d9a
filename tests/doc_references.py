"""Find the names the package's docstrings and the repository's docs point at, and say which do not exist.

Two kinds of reference are read:

* Sphinx roles in the package's source (``:mod:``, ``:class:``, ``:func:``, ``:meth:``, ``:data:``, ``:attr:``,
  ``:exc:``), absolute (``megatron_pp_ext.runtime.p2p``), relative to the module they appear in
  (``.overlap``, ``..schedules.ir.Op``) or bare (a name of that module, or a dotted path through one of its
  imports, as Sphinx resolves them in the module's namespace);
* file paths in backticks in README.md, docs/ and benchmarks/*.md whose first part is one of this repository's
  own folders (``runtime/executor.py``, ``tests/runtime/te_standin.py``, ``scripts/gpu_check.sh``). Paths of
  megatron's or torch's source (``pipeline_parallel/combined_1f1b.py``) start with a folder the repository does
  not have and are not read.

Everything is read with :mod:`ast` (nothing is imported), so the check is pure and fast. References to other
packages (``torch.``, ``megatron.``) are not resolved: their names belong to their own projects.
"""

from __future__ import annotations

import ast
import builtins
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "megatron_pp_ext"
ROLE = re.compile(r":(?:mod|class|func|meth|data|attr|exc|obj):`(?:[^`<]*<)?~?([^`>]+)>?`")
# A backticked path with a folder and a file suffix (or a trailing slash for a folder).
DOC_PATH = re.compile(r"`((?:[A-Za-z0-9_.-]+/)+[A-Za-z0-9_.-]*)(?:::[^`]*)?`")
SUBPACKAGES_AS_ROOTS = ("schedules", "analysis", "runtime", "planner", "integration", "verification", "cli")
# A path written as a pattern: a wildcard, a variable, or a placeholder in capitals (`scripts/slurm/NAME/job.sbatch`).
PLACEHOLDER = re.compile(r"[*{<$]|(?:^|/)[A-Z][A-Z_]+(?:[./]|$)")
OWN_ROOTS = (PACKAGE, "tests", "scripts", "benchmarks", "docs", "patches", ".ci", *SUBPACKAGES_AS_ROOTS)


@dataclass
class ModuleIndex:
    """What one module defines at its top level, what it imports under which name, and each class's members."""

    names: set[str] = field(default_factory=set)
    imports: dict[str, str] = field(default_factory=dict)  # local name -> absolute dotted target
    members: dict[str, set[str]] = field(default_factory=dict)  # class -> attributes and methods
    bases: dict[str, list[str]] = field(default_factory=dict)  # class -> base names as written


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _absolute(module: str, is_package: bool, level: int, target: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    if level > 1:
        base = base[: len(base) - (level - 1)]
    return ".".join([*base, *([target] if target else [])])


def _class_members(node: ast.ClassDef) -> set[str]:
    members: set[str] = set()
    for item in node.body:
        if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            members.add(item.name)
            if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                for sub in ast.walk(item):
                    if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                        members.add(sub.attr)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            members.add(item.target.id)
        elif isinstance(item, ast.Assign):
            members.update(t.id for t in item.targets if isinstance(t, ast.Name))
    return members


def index_module(path: Path) -> ModuleIndex:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    module = module_name(path)
    is_package = path.name == "__init__.py"
    index = ModuleIndex()
    for node in ast.walk(tree):  # imports inside functions count: docstrings name what a function uses
        if isinstance(node, ast.ImportFrom):
            source = _absolute(module, is_package, node.level, node.module) if node.level else (node.module or "")
            for alias in node.names:
                index.imports[alias.asname or alias.name] = f"{source}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    index.imports[alias.asname] = alias.name
                else:  # ``import a.b`` binds ``a``
                    index.imports[alias.name.split(".")[0]] = alias.name.split(".")[0]
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            index.names.add(node.name)
            if isinstance(node, ast.ClassDef):
                index.members[node.name] = _class_members(node)
                index.bases[node.name] = [ast.unparse(base) for base in node.bases]
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                index.names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            index.names.add(node.target.id)
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets):
            lazy = ast.literal_eval(node.value)  # the package root's lazily imported names: name -> module
            index.imports.update({name: f"{target}.{name}" for name, target in lazy.items()})
        elif isinstance(node, ast.If | ast.Try):  # names defined under TYPE_CHECKING or a fallback import
            for sub in ast.walk(node):
                if isinstance(sub, ast.FunctionDef | ast.ClassDef):
                    index.names.add(sub.name)
                elif isinstance(sub, ast.Assign):
                    index.names.update(t.id for t in sub.targets if isinstance(t, ast.Name))
    return index


class Resolver:
    """Resolves a dotted reference against the package's modules, read once."""

    def __init__(self) -> None:
        self.files = {module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}
        self.indexes: dict[str, ModuleIndex] = {}

    def index(self, module: str) -> ModuleIndex:
        if module not in self.indexes:
            self.indexes[module] = index_module(self.files[module])
        return self.indexes[module]

    def exists(self, dotted: str, depth: int = 0) -> bool:
        """Whether the absolute dotted name is a module of the package, or a name (and member) in one."""
        if not dotted.startswith(PACKAGE):
            return True  # another project's name
        if dotted in self.files:
            return True
        parts = dotted.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            module = ".".join(parts[:cut])
            if module in self.files:
                return self._attribute(module, parts[cut:], depth)
        return False

    def _attribute(self, module: str, rest: list[str], depth: int) -> bool:
        index = self.index(module)
        head, tail = rest[0], rest[1:]
        if head in index.imports and depth < 8:  # re-exported or imported: follow it
            return self.exists(".".join([index.imports[head], *tail]), depth + 1)
        if f"{module}.{head}" in self.files:
            return self.exists(".".join([module, *rest]) if not tail else f"{module}.{head}.{'.'.join(tail)}", depth)
        if head not in index.names:
            return False
        if not tail:
            return True
        if head not in index.members:  # a function's or a value's attribute: not checked further
            return True
        if tail[0] in index.members[head]:
            return True
        # Inherited members: accept a member of any base class this index can resolve; an outside base is trusted.
        for base in index.bases.get(head, []):
            target = index.imports.get(base.split(".")[0])
            if target is None and base in index.names:
                target = f"{module}.{base}"
            if target is None or not target.startswith(PACKAGE):
                return True
            if self.exists(f"{target}.{tail[0]}", depth + 1):
                return True
        return False

    def resolve_in(self, module: str, reference: str) -> str | None:
        """The reference as an absolute dotted name, or None where it names another project."""
        reference = reference.strip().lstrip("~").removesuffix("()")
        if reference.startswith("."):
            level = len(reference) - len(reference.lstrip("."))
            is_package = self.files[module].name == "__init__.py"
            return _absolute(module, is_package, level, reference[level:] or None)
        if reference.split(".")[0] == PACKAGE:
            return reference
        index = self.index(module)
        head, _, rest = reference.partition(".")
        if head in index.imports:
            return index.imports[head] + (f".{rest}" if rest else "")
        if head in index.names or head in index.members:
            return f"{module}.{reference}"
        if "." not in reference:
            if hasattr(builtins, reference) or any(reference in members for members in index.members.values()):
                return None  # a builtin, or a member named inside its class's docstrings (Sphinx's class context)
            return f"{module}.{reference}"  # a bare name the module does not have
        sibling = f"{module.rpartition('.')[0]}.{head}"
        if sibling in self.files:  # a neighbour module named without its dot
            return f"{sibling}.{rest}" if rest else sibling
        return None  # e.g. torch.Tensor, megatron.core...: another project's


def stale_roles(resolver: Resolver) -> Iterator[str]:
    for module, path in resolver.files.items():
        for line_number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for match in ROLE.finditer(line):
                absolute = resolver.resolve_in(module, match.group(1))
                if absolute is not None and not resolver.exists(absolute):
                    where = path.relative_to(ROOT)
                    yield f"{where}:{line_number}: {match.group(0)} (read as {absolute}) does not exist"


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md"))]


def path_exists(reference: str, resolver: Resolver) -> bool:
    """A file or folder of the repository, or ``folder/module.name`` (a name in that module)."""
    base = ROOT / PACKAGE if reference.split("/")[0] in SUBPACKAGES_AS_ROOTS else ROOT
    if (base / reference).exists():
        return True
    folder, _, last = reference.rpartition("/")
    stem, _, attribute = last.partition(".")
    module_file = base / folder / f"{stem}.py"
    if attribute and module_file.is_file() and module_file.is_relative_to(ROOT / PACKAGE):
        return resolver.exists(f"{module_name(module_file)}.{attribute}")
    return False


def stale_paths(resolver: Resolver) -> Iterator[str]:
    for doc in doc_files():
        for line_number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for match in DOC_PATH.finditer(line):
                reference = match.group(1)
                if reference.split("/")[0] not in OWN_ROOTS or PLACEHOLDER.search(reference):
                    continue
                if not path_exists(reference, resolver):
                    yield f"{doc.relative_to(ROOT)}:{line_number}: `{reference}` does not exist"
