"""The schedule IR: compute ops and their text syntax.

An op is ``(kind, stage, microbatch)``. Kinds follow the zero-bubble papers:

* ``F``  forward of one stage for one micro-batch,
* ``B``  backward for the input gradient only (weight gradient deferred),
* ``W``  backward for the weight gradient (consumes what its ``B`` deferred),
* ``BW`` full, unsplit backward.

Text syntax (used in tables and CSV cells): ``<KIND><stage>.<microbatch>``,
e.g. ``F3.0`` is the forward of stage 3 for micro-batch 0 and ``BW0.12`` the
full backward of stage 0 for micro-batch 12. Stages and micro-batches are
0-based global indices; the placement says which rank and chunk run a stage.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from functools import lru_cache, partial
from itertools import repeat
from typing import NamedTuple


class OpKind(enum.StrEnum):
    F = "F"
    B = "B"
    W = "W"
    BW = "BW"


class ScheduleError(ValueError):
    """Base class of every error about a schedule a user can act on."""


class ScheduleSyntaxError(ScheduleError):
    """A cell or file does not follow the schedule text syntax."""


_OP_RE = re.compile(r"^\s*(BW|F|B|W)(\d+)\.(\d+)\s*$")


class Op(NamedTuple):
    """One compute op of a schedule (a named tuple: cheap to build, hash and sort)."""

    kind: OpKind
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.microbatch}"

    def __repr__(self) -> str:
        return f"Op({self})"

    @property
    def is_backward(self) -> bool:
        return self.kind in (OpKind.B, OpKind.BW)

    @classmethod
    def parse(cls, text: str) -> Op:
        match = _OP_RE.match(text)
        if match is None:
            raise ScheduleSyntaxError(
                f"cannot parse op {text!r}: expected <KIND><stage>.<microbatch> with KIND in "
                "F, B, W, BW (e.g. F3.0, BW0.12)"
            )
        kind, stage, mb = match.groups()
        return cls(OpKind(kind), int(stage), int(mb))


_new_op = partial(tuple.__new__, Op)


def ops_of(kind: OpKind, stages: Iterable[int], microbatches: Iterable[int]) -> list[Op]:
    """``[Op(kind, s, mb) for s, mb in zip(stages, microbatches)]``, built without a Python call per op
    (generators of large schedules use it)."""
    return list(map(_new_op, zip(repeat(kind), stages, microbatches)))


def F(stage: int, microbatch: int) -> Op:
    return Op(OpKind.F, stage, microbatch)


def B(stage: int, microbatch: int) -> Op:
    return Op(OpKind.B, stage, microbatch)


def W(stage: int, microbatch: int) -> Op:
    return Op(OpKind.W, stage, microbatch)


def BW(stage: int, microbatch: int) -> Op:
    return Op(OpKind.BW, stage, microbatch)


@lru_cache(maxsize=6)  # F, B and W of two layouts
def op_grid(kind: OpKind, num_stages: int, num_microbatches: int) -> tuple[tuple[Op, ...], ...]:
    """``grid[stage][microbatch]``: every op of one kind, built once and shared (ops are immutable).
    List schedulers that try several orders of the same ``(stages, micro-batches)`` take their ops from
    here instead of building one tuple per op per try."""
    return tuple(tuple(ops_of(kind, repeat(s, num_microbatches), range(num_microbatches))) for s in range(num_stages))
