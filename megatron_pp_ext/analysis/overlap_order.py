"""The order an overlapped run executes: a schedule's warm-up deepened where its pairs need it, pairs marked.

With ``--overlap-moe-expert-parallel-comm`` each overlap pair (a forward and another micro-batch's
backward, :mod:`megatron_pp_ext.schedules.pairs`) runs as one combined step whose two outputs leave at
its end. In a schedule built for separate ops, a steady-state pair's backward input is produced by the
neighbour's pair of the same step, so the ranks take turns and the overlap costs more than it hides
(1F1B at p = 4, m = 8, unit costs, two MoE layers with all-to-alls of 0.5: 77 without overlap, 105 with).
Moving each rank's backwards later by a few forwards (:func:`~megatron_pp_ext.schedules.pairs.deepen`)
gives every pair inputs from an earlier step: megatron-core's interleaved 1F1B runs one extra warm-up
micro-batch with the flag for this reason (a lag of one), and a one-chunk 1F1B needs ``p - r`` on rank
``r`` (rank 0 then holds ``2p`` micro-batches' activations instead of ``p``; same example: 56).

:func:`overlap_order` tries the lags of :func:`lag_candidates` (none, one on every rank, ``p - r``,
``r + 1``),
keeps those that are valid (no waits in a cycle, no pair waiting on itself), simulates each with its
pairs on two streams under reference costs (forward, backward and weight gradient of one unit each,
one MoE layer per stage whose all-to-alls take a quarter unit: communication about half of the
compute, where overlap is worth turning on) and returns the fastest, the smaller lag on a tie. The
choice depends on the schedule alone, so every rank makes the same one.
"""

from __future__ import annotations

from ..schedules.ir import ScheduleError
from ..schedules.pairs import blocked_pairs, deepen, mark_pairs
from ..schedules.schedule import Schedule
from .moe_comm import MoeComm
from .schedule_check import validate
from .simulate import simulate

__all__ = ["REFERENCE_A2A", "lag_candidates", "overlap_order"]

#: The reference all-to-all time (one dispatch or combine of one MoE layer) in units of one op's compute.
REFERENCE_A2A = 0.25


def lag_candidates(schedule: Schedule) -> list[tuple[int, ...]]:
    """The lags tried, one per rank: none, one everywhere (megatron-core's extra warm-up micro-batch),
    ``p - r`` on rank ``r`` (a one-chunk pipeline's lockstep: the first rank waits longest for its
    backwards) and ``r + 1`` (a V's lockstep: the last rank holds the turn from the forward chunks to the
    backward ones)."""
    p = schedule.num_ranks
    found: list[tuple[int, ...]] = []
    for lags in ((0,) * p, (1,) * p, tuple(p - r for r in range(p)), tuple(r + 1 for r in range(p))):
        if lags not in found:
            found.append(lags)
    return found


def overlap_order(schedule: Schedule) -> Schedule:
    """``schedule`` as an overlapped run executes it (module doc); unchanged when it already has pairs
    (DualPipeV's generator marks its own) or has no forward and backward to pair."""
    if schedule.overlap_pairs:
        return schedule
    best: tuple[float, int, Schedule] | None = None
    for lags in lag_candidates(schedule):
        timed = _timed(schedule, lags)
        if timed is not None and (best is None or timed[:2] < best[:2]):
            best = timed
    return mark_pairs(schedule) if best is None else best[2]


def _timed(schedule: Schedule, lags: tuple[int, ...]) -> tuple[float, int, Schedule] | None:
    """(makespan, total lag, marked schedule) of ``schedule`` deepened by ``lags``; None if not valid."""
    try:
        deepened = schedule if not any(lags) else deepen(schedule, lags)
        marked = mark_pairs(deepened)
        if not marked.overlap_pairs or blocked_pairs(marked):
            return None
        moe = MoeComm(REFERENCE_A2A, 1, overlap=True)
        makespan = simulate(marked, lowered=validate(marked), moe=moe).makespan
    except (ScheduleError, ValueError):
        return None
    return makespan, sum(lags), marked
