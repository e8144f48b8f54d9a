"""The realized share: what part of the improvement the simulator promises a run actually delivers.

``(measured gain - 1) / (simulated gain - 1)``, gains as time of the baseline / time of the schedule. It is
the figure the benchmarks judge a schedule by: the ratio of the two gains hides a miss (a schedule that
gained nothing against a simulated 5% shows 0.95 as a ratio of gains, 0.00 as a realized share).
"""

from __future__ import annotations

__all__ = ["MIN_SIM_GAIN", "realized_share", "realized_text"]

#: Below this simulated improvement (gain - 1) the share is not defined: a ratio of two small numbers, or, for a
#: schedule the simulator expects to be slower than the baseline, no improvement to realize (there measured /
#: simulated judges the run).
MIN_SIM_GAIN = 0.01


def realized_share(measured_gain: float, simulated_gain: float) -> float | None:
    """``(measured_gain - 1) / (simulated_gain - 1)``; None where the simulator promises no improvement of at
    least :data:`MIN_SIM_GAIN`."""
    if simulated_gain - 1 < MIN_SIM_GAIN:
        return None
    return (measured_gain - 1) / (simulated_gain - 1)


def realized_text(measured_gain: float, simulated_gain: float) -> str:
    """The share with two decimals, ``n/a`` where it is not defined."""
    share = realized_share(measured_gain, simulated_gain)
    return "n/a" if share is None else f"{share:.2f}"
