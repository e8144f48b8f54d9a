"""A schedule's ops as flat integer arrays (one entry per op, rank by rank), cached on the schedule.

The lowering, the validator and the simulator read these instead of walking ``Op`` tuples one
by one: a schedule with a quarter of a million ops is then lowered, checked and timed in about a
second (``benchmarks/bench_ir_speed.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate, chain
from operator import itemgetter

import numpy as np

from .ir import OpKind, ScheduleError
from .schedule import Schedule

__all__ = ["KIND_B", "KIND_BW", "KIND_CODE", "KIND_F", "KIND_W", "OpArrays", "op_arrays"]

#: Integer code of each op kind in :attr:`OpArrays.kind`.
KIND_F, KIND_B, KIND_W, KIND_BW = 0, 1, 2, 3
KIND_CODE = {OpKind.F: KIND_F, OpKind.B: KIND_B, OpKind.W: KIND_W, OpKind.BW: KIND_BW}


@dataclass(frozen=True, eq=False)
class OpArrays:
    """Op ``i`` (global id, ranks in order) is ``schedule.ops[rank[i]][index[i]]``."""

    offsets: tuple[int, ...]  # global id of each rank's first op; offsets[-1] = number of ops
    kind: np.ndarray  # KIND_* code
    stage: np.ndarray
    microbatch: np.ndarray
    rank: np.ndarray
    index: np.ndarray  # position on its rank

    @property
    def total(self) -> int:
        return self.offsets[-1]

    def slice(self, rank: int) -> slice:
        return slice(self.offsets[rank], self.offsets[rank + 1])


def op_arrays(schedule: Schedule) -> OpArrays:
    """The arrays of ``schedule`` (built once; schedules are immutable)."""
    cached = schedule.__dict__.get("_op_arrays")
    if cached is None:
        cached = _build(schedule)
        object.__setattr__(schedule, "_op_arrays", cached)
    return cached


def _build(schedule: Schedule) -> OpArrays:
    rows = schedule.ops
    lengths = [len(row) for row in rows]
    offsets = (0, *accumulate(lengths))
    total = offsets[-1]
    flat = list(chain.from_iterable(rows))
    kinds = list(map(itemgetter(0), flat))
    if not set(map(type, kinds)) <= {OpKind}:
        rank, op = next((r, op) for r, row in enumerate(rows) for op in row if type(op[0]) is not OpKind)
        raise ScheduleError(
            f"rank {rank}: op {tuple(op)!r} has kind {op[0]!r}, not an OpKind (build ops with Op.parse or F/B/W/BW)"
        )
    kind = np.fromiter(map(KIND_CODE.__getitem__, kinds), dtype=np.int8, count=total)
    rank_ids = np.repeat(np.arange(len(rows), dtype=np.int64), lengths)
    index = np.arange(total, dtype=np.int64) - np.repeat(np.asarray(offsets[:-1], dtype=np.int64), lengths)
    return OpArrays(
        offsets,
        kind,
        np.fromiter(map(itemgetter(1), flat), dtype=np.int64, count=total),
        np.fromiter(map(itemgetter(2), flat), dtype=np.int64, count=total),
        rank_ids,
        index,
    )
