"""Import layering: no import cycle at module load time anywhere in the package; with function-level
imports included, exactly one circle (the schedule registry's self-registration: ``registry`` loads
``generators``, whose modules register with it), none between ``cli`` and ``runtime`` or between
``planner.memory`` and ``planner.models``, and no import from a pure layer up to a later one. The graph
is read statically from the source (``ast``): pure and fast; imports under ``if TYPE_CHECKING:`` never
run and are left out."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.import_graph import ROOT, cycles, import_graph


def test_the_graph_sees_the_package() -> None:
    graph = import_graph(top_level=False)
    assert "megatron_pp_ext.schedules.engine" in graph["megatron_pp_ext.schedules.generators.zbv"]
    assert "megatron_pp_ext.cli.verify_command" in graph["megatron_pp_ext.cli.cmd_verify"]  # a function-level import
    assert "megatron_pp_ext.cli.verify_command" not in import_graph(top_level=True)["megatron_pp_ext.cli.cmd_verify"]
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
        ("megatron_pp_ext.verification", "megatron_pp_ext.bench"),
        ("megatron_pp_ext.verification", "megatron_pp_ext.selfcheck"),
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
        "megatron_pp_ext.cli.verify_command",
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
    above = [*LAYERS[LAYERS.index(layer) + 1 :], "cli", "runtime", "integration", "verification", "selfcheck", "bench"]
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


@pytest.mark.parametrize("job", ["selfcheck", "bench", "cli"])
def test_verify_does_not_import_the_jobs_built_on_it(job: str) -> None:
    """``verification`` (the verify job) is below the self-checks, the benchmarks and the CLI: it imports none
    of them, not even in a function (mode AB's timing module is looked up by name in ``rank_run``)."""
    bad = sorted(
        f"{module} -> {dep}"
        for module, deps in import_graph(top_level=False).items()
        if module.startswith("megatron_pp_ext.verification")
        for dep in deps
        if dep == f"megatron_pp_ext.{job}" or dep.startswith(f"megatron_pp_ext.{job}.")
    )
    assert not bad, bad
