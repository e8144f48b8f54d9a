"""Exposed data-parallel time for the planner: per-chunk gradient reductions on a stream per rank.

The planner times the pipeline through a compiled program that yields the makespan only; the full
data-parallel stream of :func:`megatron_pp_ext.analysis.simulate.simulate` (``dp=...``) needs every
op's time. This estimates the part of the gradient reduction left after the pipeline from the op
order alone: chunk ``c`` of rank ``r`` starts its reduction when its last gradient op (``B``, ``W``
or ``BW``, as :func:`~megatron_pp_ext.schedules.collectives.derive_collectives` places it) ends,
which is at the latest the rank's end minus the compute still queued behind that op (idle time
behind it only makes the estimate pessimistic). The reductions run in issue order; what is left
after the rank's end is its tail, and the iteration adds the worst rank's tail to the makespan.

With one chunk per rank (1F1B, GPipe, the zero-bubble family) the last gradient op is the rank's
last op: the tail is the whole reduction, as before. Looped and V placements hide the reductions
of the chunks that finish early (breadth-first: all but the last one).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..schedules.ir import OpKind
from ..schedules.schedule import Schedule

__all__ = ["ReductionProfile", "exposed_dp_time", "reduction_profile"]

_CODE = {OpKind.F: 0, OpKind.B: 1, OpKind.W: 2, OpKind.BW: 3}
_MAKES_GRADS = (OpKind.B, OpKind.W, OpKind.BW)

#: per chunk in issue order: (its global stage, ((kind code, stage, count), ...) of the ops after it)
RankProfile = tuple[tuple[int, tuple[tuple[int, int, int], ...]], ...]


@dataclass(frozen=True)
class ReductionProfile:
    """Per rank, its chunks in reduction order with the compute queued behind each reduction."""

    ranks: tuple[RankProfile, ...]


def reduction_profile(schedule: Schedule) -> ReductionProfile:
    ranks = []
    for ops in schedule.ops:
        last: dict[int, int] = {}
        for i, op in enumerate(ops):
            if op.kind in _MAKES_GRADS:
                last[op.stage] = i
        chunks = []
        for stage, i in sorted(last.items(), key=lambda item: item[1]):
            behind: dict[tuple[int, int], int] = {}
            for op in ops[i + 1 :]:
                key = (_CODE[op.kind], op.stage)
                behind[key] = behind.get(key, 0) + 1
            chunks.append((stage, tuple((code, st, n) for (code, st), n in sorted(behind.items()))))
        ranks.append(tuple(chunks))
    return ReductionProfile(tuple(ranks))


def exposed_dp_time(
    profile: ReductionProfile, tables: Sequence[Sequence[float]], chunk_time: Sequence[dict[int, float]]
) -> float:
    """The worst rank's reduction time left after its last op. ``tables``: per-stage
    ``(t_f, t_b, t_w, t_bw)``; ``chunk_time[r][stage]``: reduction time of that chunk of rank ``r``."""
    worst = 0.0
    for rank, chunks in enumerate(profile.ranks):
        drain = -float("inf")  # relative to the rank's end
        for stage, behind in chunks:
            issue = -sum(n * tables[code][st] for code, st, n in behind)
            drain = max(drain, issue) + chunk_time[rank].get(stage, 0.0)
        worst = max(worst, drain)
    return worst
