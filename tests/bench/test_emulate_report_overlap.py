"""The emulated report's overlap tables and figure, from a made-up outcome (pure; bench/emulate_report.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from megatron_pp_ext.bench import emulate_report
from megatron_pp_ext.bench.emulate_results import Outcome, Row, Settings


def _outcome() -> Outcome:
    settings = Settings(2, 8, ("1f1b", "interleaved-1f1b"), 5, 2, 40, 40, 30, None, 20.0, 1, True)
    rows = [
        Row("1f1b", 1, 1700.0, measured=1740.0, sim_gain=1.0, measured_gain=1.0),
        Row("1f1b", 1, 1300.0, overlap=True, measured=1270.0, sim_gain=1.31, measured_gain=1.37),
        Row("interleaved-1f1b", 2, 1600.0, measured=1650.0, sim_gain=1.06, measured_gain=1.05),
        Row(
            "interleaved-1f1b",
            2,
            1230.0,
            overlap=True,
            measured=1350.0,
            sim_gain=1.38,
            measured_gain=1.29,
            native="interleaved-1f1b",
            native_measured=1340.0,
            ours_vs_native=1.007,
        ),
    ]
    return Outcome(settings, 0.1, 0.08, rows, {}, (0.5, 0.6), 100.0)


def test_the_overlap_table_gives_the_realized_share_of_the_simulated_gain() -> None:
    text = emulate_report.report(_outcome())
    row = next(line for line in text.splitlines() if line.startswith("| interleaved-1f1b | 1650.0 | 1350.0"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    measured, simulated = 1650.0 / 1350.0, 1600.0 / 1230.0
    assert cells[3:] == [
        f"{measured:.3f}",
        f"{simulated:.3f}",
        f"{measured / simulated:.3f}",
        f"{(measured - 1) / (simulated - 1):.2f}",
    ]


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_the_overlap_figure_draws_times_without_and_with_beside_megatrons(tmp_path: Path) -> None:
    path = emulate_report.draw(_outcome(), str(tmp_path))
    assert path.name == "emulated_overlap_p2_m8_a2a20ms_x1.png"
    assert path.stat().st_size > 0


def test_host_costs_are_the_time_between_ops_per_op_and_the_posting_per_sending_op() -> None:
    from megatron_pp_ext.bench.emulate_bench import host_costs_ms
    from megatron_pp_ext.schedules import generate

    schedule = generate("1f1b", 2, 4)  # rank 0: 4 F send, 4 BW do not; rank 1: 4 F do not, 4 BW send
    row = Row("1f1b", 1, 100.0)
    row.ranks = [{"rank": 0, "between": 1.6, "post": 2.0}, {"rank": 1, "between": 2.4, "post": 4.0}]
    per_op, per_exchange = host_costs_ms(schedule, row)
    assert per_op == pytest.approx((1.6 / 8 + 2.4 / 8) / 2)
    assert per_exchange == pytest.approx((2.0 / 4 + 4.0 / 4) / 2)
