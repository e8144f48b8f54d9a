"""Test tiers (see ``tiers.py``): real-rank tests get the ``gloo`` marker at collection, and every other test
runs under the rank guard, so an unmarked real-rank test fails with "mark this test gloo"."""

from __future__ import annotations

import os

import pytest

from tests.tier_guard import rank_guard
from tests.tiers import calls_rank_launcher, fixture_launches_ranks


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
