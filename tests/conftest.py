"""Fixtures shared by the test directories, and the test tiers (see ``tiers.py``).

Real-rank tests get the ``gloo`` marker at collection, and every other test runs under the rank guard, so an
unmarked real-rank test fails with "mark this test gloo". Each test's CPU time (its process and the children
it waited for) is measured, and the tests outside ``gloo`` and ``slow`` that take longer than
:data:`tests.tiers.SLOW_CPU_S` are listed at the end of the run (mark them slow: the quick tier has about two
minutes).

``pool``: one pool of gloo rank processes for the whole session, used by the real-rank tests of tests/runtime and
tests/verification alike; warm (``TrainingRankPool(warm_module=WARM_MODULE)``): its workers are forked from a
process that has imported torch and megatron once, instead of importing them for ~6 s of CPU each."""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Iterator

import pytest

from megatron_pp_ext.verification.rank_run import TrainingRankPool
from tests.tier_guard import rank_guard
from tests.tiers import SLOW_CPU_S, calls_rank_launcher, fixture_launches_ranks, launches_ranks
from tests.warm_pool import WARM_MODULE

_CPU_S: dict[str, float] = {}  # node id -> CPU seconds of the quick-tier tests


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("gloo") is not None or not isinstance(item, pytest.Function):
            continue
        fixtures = item._fixtureinfo.name2fixturedefs.values()
        if fixture_launches_ranks(defs[-1].func for defs in fixtures) or calls_rank_launcher(item.obj):
            item.add_marker(pytest.mark.gloo)


@pytest.fixture(autouse=True)
def _rank_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside ``gloo`` tests, a rank launch (here or in a child interpreter) fails at once."""
    if request.node.get_closest_marker("gloo") is not None:
        return
    test = request.node.nodeid
    monkeypatch.setenv(rank_guard.ENV, test)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [rank_guard.HERE, os.environ.get("PYTHONPATH")])))
    rank_guard.install(test, monkeypatch.setattr)


def _cpu_s() -> float:
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    start = _cpu_s()
    yield
    if item.get_closest_marker("gloo") is None and item.get_closest_marker("slow") is None:
        _CPU_S[item.nodeid] = _cpu_s() - start


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    over = sorted(((s, node) for node, s in _CPU_S.items() if s > SLOW_CPU_S), reverse=True)
    if _CPU_S:
        terminalreporter.write_line(f"quick-tier tests: {sum(_CPU_S.values()):.0f} s of CPU in {len(_CPU_S)} tests")
    if over:
        terminalreporter.write_sep("-", f"{len(over)} quick-tier tests over {SLOW_CPU_S:g} s of CPU: mark them slow")
        for seconds, node in over:
            terminalreporter.write_line(f"{seconds:6.1f} s  {node}")


@pytest.fixture(scope="session")
@launches_ranks
def pool():
    with TrainingRankPool(4, warm_module=WARM_MODULE) as ranks:
        yield ranks
