"""The realized share the benchmark reports judge a schedule by (bench/realized.py)."""

from __future__ import annotations

import pytest

from megatron_pp_ext.bench.realized import realized_share, realized_text


def test_a_schedule_that_gained_nothing_realized_nothing() -> None:
    assert realized_share(1.0, 1.05) == 0.0  # its ratio of gains would read 0.95
    assert realized_share(1.05, 1.05) == pytest.approx(1.0)
    assert realized_share(1.025, 1.05) == pytest.approx(0.5)
    assert realized_share(0.95, 1.05) == pytest.approx(-1.0)  # slower than the baseline


def test_no_share_where_the_simulator_promises_no_improvement() -> None:
    assert realized_share(1.2, 1.005) is None
    assert realized_share(0.98, 0.96) is None  # a simulated loss: measured / simulated judges that run
    assert realized_text(1.2, 1.005) == "n/a"
    assert realized_text(1.1, 1.2) == "0.50"
