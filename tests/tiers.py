"""The two test tiers: which tests are real-rank tests (the ``gloo`` marker), found from what they use.

``bash scripts/run_tests.sh --quick`` runs ``-m "not gloo and not slow"``: pure and single-process tests, in
about two minutes. ``slow`` marks, by hand, the few pure tests that take seconds of CPU each (the root
``conftest.py`` lists the unmarked ones over :data:`SLOW_CPU_S` after every run). A test is a real-rank test when

* it carries ``pytest.mark.gloo`` itself (or through ``pytestmark``), or
* one of its fixtures, directly or through other fixtures, is tagged with :func:`launches_ranks` (the rank
  pools), or
* its body calls, directly or through functions of its own module, a function tagged with
  :func:`launches_ranks` (a test's torchrun launcher, say).

The root ``conftest.py`` adds the marker to such tests at collection and runs every other test under the guard of
``tier_guard/rank_guard.py``, so a real-rank test that none of the above finds fails at its launch with "mark this
test gloo" instead of slowing the quick tier.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Container, Iterable, Iterator
from types import CodeType
from typing import Any, TypeVar

import pytest

F = TypeVar("F", bound=Callable[..., Any])
TAG = "launches_ranks"
#: A test over this many seconds of CPU (measured on two idle cores) belongs in the full tier: mark it ``slow``.
SLOW_CPU_S = 2.5


def slow_params(values: Iterable[Any], slow: Container[Any]) -> list[Any]:
    """Parameters for ``pytest.mark.parametrize`` with those in ``slow`` marked ``slow`` (same test ids)."""
    return [pytest.param(value, marks=pytest.mark.slow) if value in slow else value for value in values]


def launches_ranks(func: F) -> F:
    """Tag a fixture or helper that starts rank processes or a process group: its tests are ``gloo`` tests."""
    setattr(func, TAG, True)
    return func


def is_tagged(obj: Any) -> bool:
    return bool(getattr(obj, TAG, False))


def fixture_launches_ranks(fixture_functions: Iterator[Callable[..., Any]]) -> bool:
    """Whether any of a test's fixtures (its whole closure) is tagged."""
    return any(is_tagged(inspect.unwrap(func)) for func in fixture_functions)


def calls_rank_launcher(func: Callable[..., Any]) -> bool:
    """Whether ``func`` names a tagged function, directly or through the functions of its own module it names
    (a static look at the names its code uses: enough for the way tests call their launch helpers)."""
    func = inspect.unwrap(func)
    module_globals = getattr(func, "__globals__", {})
    seen: set[int] = set()
    todo = [func]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        for name in _names(current.__code__):
            obj = module_globals.get(name)
            if is_tagged(obj):
                return True
            if inspect.isfunction(obj) and obj.__globals__ is module_globals:
                todo.append(obj)
    return False


def _names(code: CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, CodeType):  # nested functions, lambdas and comprehensions
            yield from _names(const)
