"""Import a ``torch.distributed.pipelining`` compute order into the schedule IR (no torch import here).

torch's schedules (``torch/distributed/pipelining/schedules.py``, read in torch 2.13.0) keep, per rank, a
list of ``_Action(stage_index, computation_type, microbatch_index, sub_actions)``. Its letters differ from
ours: torch ``F`` = our ``F``; torch ``I`` (BACKWARD_INPUT) = our ``B``; torch ``W`` = our ``W``; torch
``B`` (FULL_BACKWARD) = our ``BW``; ``OVERLAP_F_B`` holds two sub-actions (a forward and a full backward)
that become one of our overlap pairs. ``None`` entries (idle slots) are skipped; communication and FSDP
actions are refused (import the compute-only order, before torch adds its communication).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .ir import Op, OpKind, ScheduleSyntaxError
from .placement import Placement
from .schedule import Schedule

__all__ = ["TORCH_KINDS", "from_torch_order"]

#: torch's computation-type letters -> our op kinds.
TORCH_KINDS = {"F": OpKind.F, "I": OpKind.B, "W": OpKind.W, "B": OpKind.BW}
_OVERLAP = "OVERLAP_F_B"


def _kind(action: Any) -> str:
    kind = action.computation_type
    return str(getattr(kind, "value", kind))


def _op(action: Any) -> Op:
    kind = _kind(action)
    if kind not in TORCH_KINDS:
        raise ScheduleSyntaxError(f"torch action {action!r}: {kind} is not a compute action of the IR")
    return Op(TORCH_KINDS[kind], int(action.stage_index), int(action.microbatch_index))


def from_torch_order(
    order: Mapping[int, Iterable[Any]], placement: Placement, num_microbatches: int, name: str = "torch"
) -> Schedule:
    """The schedule torch's ``pipeline_order`` (rank -> actions) describes on ``placement``."""
    rows: list[list[Op]] = []
    pairs: list[list[int]] = []
    for rank in range(placement.num_ranks):
        row: list[Op] = []
        starts: list[int] = []
        for action in order[rank]:
            if action is None:
                continue
            if _kind(action) == _OVERLAP:
                starts.append(len(row))
                row += [_op(sub) for sub in action.sub_actions]
            else:
                row.append(_op(action))
        rows.append(row)
        pairs.append(starts)
    schedule = Schedule(placement, num_microbatches, tuple(map(tuple, rows)), name=name)
    return schedule.with_overlap_pairs(pairs) if any(pairs) else schedule
