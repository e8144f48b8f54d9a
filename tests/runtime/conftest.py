"""One pool of gloo rank processes for the whole session (spawning costs ~6 s of imports per rank)."""

from __future__ import annotations

import pytest

from megatron_pp_ext.verification.verify import RankPool
from tests.tiers import launches_ranks


@pytest.fixture(scope="session")
@launches_ranks
def pool():
    with RankPool(4) as ranks:
        yield ranks
