"""Closed forms from the papers against the simulator, over a grid.

Unit costs (T_F = T_B = T_W = 1 per stage, BW = B + W, zero communication). For interleaved
1F1B a "stage" is one of the v*p smaller stages, so the bubble formula (p-1)/(v m + p-1) is
in those units, and peak activations are counted in that schedule's stage units (divide by v
for 1F1B units).
"""

from __future__ import annotations

import pytest

from megatron_pp_ext.analysis.simulate import SimResult, simulate
from megatron_pp_ext.schedules import ScheduleError, generate, lower
from megatron_pp_ext.schedules.costs import Costs

P_GRID = range(2, 17)
V_GRID = range(1, 5)


def m_grid(p: int, thin: bool = False) -> list[int]:
    """m in 1..4p; ``thin`` keeps only the boundary cases for p > 8 (to keep the suite fast)."""
    if thin and p > 8:
        return sorted({1, 2, p - 1, p, p + 1, 2 * p - 1, 2 * p, 3 * p + 1, 4 * p})
    return list(range(1, 4 * p + 1))


def sim(name: str, p: int, m: int, v: int | None) -> SimResult | None:
    try:
        schedule = generate(name, p, m, v=v)
    except ScheduleError:
        return None  # outside the schedule's (megatron's) constraints: skip
    # Lowered directly: this module checks timing and memory; validity (including deadlock
    # freedom) is checked by test_generate_properties.py and test_validity.py.
    return simulate(schedule, Costs.unit(), lowered=lower(schedule))


def interleaved_peak(p: int, r: int, m: int, v: int) -> int:
    """Live activations on rank r: warm-up forwards, +1 for the first steady-state forward."""
    warmup = min(2 * (p - r - 1) + (v - 1) * p, m * v)
    return min(warmup + 1, m * v)


@pytest.mark.parametrize("p", P_GRID)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_1f1b_closed_forms(name: str, p: int) -> None:
    bad = []
    for m in m_grid(p, thin=name == "gpipe"):  # GPipe's closed forms hold by construction
        for v in V_GRID:
            result = sim(name, p, m, v)
            if result is None:
                assert v != 1, f"{name} refused p={p} m={m} v=1"
                continue
            bubble = (p - 1) / (m + p - 1)
            peak = [m] * p if name == "gpipe" else [min(p - r, m) for r in range(p)]
            got = (result.bubble_rate, result.sync_bubble_rate, list(result.peak_activations))
            if got[:2] != pytest.approx((bubble, bubble), rel=1e-9, abs=1e-12) or got[2] != peak:
                bad.append((m, v, got, (bubble, peak)))
            assert list(result.peak_activations_1f1b_units) == peak
            assert result.p2p_messages == 2 * (p - 1) * m
            assert result.local_handoffs == 0
    assert not bad, f"{name} p={p}: (m, v, got, expected) {bad[:5]}"


@pytest.mark.parametrize("p", P_GRID)
def test_interleaved_closed_forms(p: int) -> None:
    checked = 0
    bad = []
    for m in m_grid(p):
        for v in V_GRID:
            if v == 1:
                with pytest.raises(ScheduleError, match="1f1b"):
                    generate("interleaved-1f1b", p, m, v=v)
                continue
            result = sim("interleaved-1f1b", p, m, v)
            if result is None:
                assert m < p or m % p != 0  # megatron's constraints with the default group size p
                continue
            checked += 1
            bubble = (p - 1) / (v * m + p - 1)
            peak = [interleaved_peak(p, r, m, v) for r in range(p)]
            got = (result.bubble_rate, result.sync_bubble_rate, list(result.peak_activations))
            if got[:2] != pytest.approx((bubble, bubble), rel=1e-9, abs=1e-12) or got[2] != peak:
                bad.append((m, v, got, (bubble, peak)))
            assert list(result.peak_activations_1f1b_units) == pytest.approx([x / v for x in peak])
            assert result.p2p_messages == 2 * (p * v - 1) * m
            if m >= 2 * p:  # the interleaved 1F1B closed form, rank 0, m % p == 0: (2(p-1) + (v-1)p + 1) stage units
                assert result.peak_activations[0] == 2 * (p - 1) + (v - 1) * p + 1
            else:  # m == p: the warm-up holds every forward, so the peak is m v, below the formula
                assert result.peak_activations[0] == m * v < 2 * (p - 1) + (v - 1) * p + 1
    assert checked == 12  # m in {p, 2p, 3p, 4p} x v in {2, 3, 4}
    assert not bad, f"interleaved p={p}: (m, v, got, expected) {bad[:5]}"
