"""One pool of gloo rank processes for the whole session (spawning costs ~6 s of imports per rank)."""

from __future__ import annotations

import pytest

from megatron_pp_ext.verification.verify import RankPool


@pytest.fixture(scope="session")
def pool():
    with RankPool(4) as ranks:
        yield ranks
