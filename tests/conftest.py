"""Fixtures shared by the test directories.

``pool``: one pool of gloo rank processes for the whole session (spawning costs ~6 s of imports per
rank), used by the real-rank tests of tests/runtime and tests/verification alike.
"""

from __future__ import annotations

import pytest

from megatron_pp_ext.verification.rank_run import RankPool


@pytest.fixture(scope="session")
def pool():
    with RankPool(4) as ranks:
        yield ranks
