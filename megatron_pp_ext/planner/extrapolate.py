"""Extrapolation from short anchor runs: for many micro-batches (``m > max(32, 4p)``) a schedule is
built, validated and simulated at three anchors ``m0 = 2p + (m mod p)``, ``m0 + p``, ``m0 + 2p`` only,
and the makespan, busy time and per-rank peak activations are extrapolated linearly to ``m`` with the
later slope when the two slopes agree within 5% (a peak that stopped growing keeps its largest value);
otherwise (a greedy schedule whose cost is not affine in ``m``) the schedule is built and simulated at
``m`` itself when ``m <= 8p``, and extrapolated anyway beyond (flagged ``approximate``, ``m~?`` in the
table) since such a simulation can take seconds per configuration. The anchors have ``m``'s residue
modulo ``p``, so a generator's divisibility constraints hold for them; one that refuses an anchor is
simulated at ``m``."""

from __future__ import annotations

from collections.abc import Sequence

from .memory import RankMemory

EXACT_MIN = 32  # micro-batch counts up to max(EXACT_MIN, 4p) are simulated exactly
EXACT_FALLBACK = 8  # non-affine schedules are simulated at m itself up to m = 8p, approximated beyond
TOLERANCE = 0.05  # relative difference of the two slopes up to which values count as affine in m


def anchor_counts(p: int, m: int) -> list[int]:
    """Micro-batch counts to simulate for ``m``: ``[m]``, or two anchors to extrapolate from
    (``m0`` in ``[2p, 3p)`` with ``m0 = m (mod p)``, ``m0 + p`` and ``m0 + 2p``)."""
    m0 = 2 * p + (m % p)
    if m <= max(EXACT_MIN, 4 * p) or m0 + 2 * p >= m:
        return [m]
    return [m0, m0 + p, m0 + 2 * p]


def affine_at(xs: Sequence[int], ys: Sequence[float], x: int, tolerance: float = TOLERANCE) -> float | None:
    """Extrapolate ``ys(xs)`` to ``x`` with the slope of the last two points, or ``None`` when the
    earlier slope differs from it by more than ``tolerance`` (relative): the values do not grow
    linearly (yet). A last slope <= 0 (a saturated memory peak, or a greedy schedule that keeps
    less alive with more micro-batches) gives the largest value seen, conservatively."""
    slopes = [(ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i]) for i in range(len(xs) - 1)]
    last = slopes[-1]
    if last <= 0:
        return max(ys)
    if any(abs(a - last) > tolerance * abs(last) for a in slopes):
        return None
    return ys[-1] + last * (x - xs[-1])


def affine_memory(
    ms: Sequence[int], per_anchor: Sequence[Sequence[RankMemory]], m: int, tolerance: float
) -> list[RankMemory] | None:
    """Each rank's memory at ``m`` from its memory at the anchors ``ms``: the activations and the p2p
    buffers extrapolated (never below the last anchor's), the rest as at the last anchor; ``None``
    if not affine."""
    out = []
    for ranks in zip(*per_anchor, strict=True):
        value = affine_at(ms, [r.activations for r in ranks], m, tolerance)
        buffers = affine_at(ms, [r.p2p_buffers for r in ranks], m, tolerance)
        if value is None or buffers is None:
            return None
        last = ranks[-1]
        out.append(
            RankMemory(
                rank=last.rank,
                parameters=last.parameters,
                weights=last.weights,
                gradients=last.gradients,
                optimizer=last.optimizer,
                activations=max(value, last.activations),
                transient=last.transient,
                p2p_buffers=max(buffers, last.p2p_buffers),
            )
        )
    return out
