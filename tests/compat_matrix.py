"""The compatibility matrix of the README: schedule families x megatron features, each cell backed by a test.

A cell is one of

* :class:`Verify`: ``megatron-pp verify`` of the family's schedule with the feature on (losses and every
  gradient of every iteration against the float64 and megatron fp32 references, :mod:`criterion`), run by
  ``tests/verification/test_compat_matrix.py``;
* :class:`PostValidated`: the schedule stepped by post-validation against megatron's synchronous step on the
  same ranks, weights bitwise equal after a forced rollback (same file);
* :class:`Covered`: a test elsewhere that runs this combination on real ranks (its node id; a pure test
  checks that it exists);
* :class:`Refused`: the combination stops with one line before any process group (``test_compat_matrix``
  checks the line).

No cell may be missing: ``tests/test_compat_readme.py`` checks that every row has every column and that the
README's table is :func:`render`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

P, M = 2, 4  # every cell: two pipeline ranks, four micro-batches

#: family (README row) -> its schedule
ROWS = {
    "loop, 1F1B": "1f1b",
    "loop, interleaved": "interleaved-1f1b",
    "loop, B/W split": "zb-h1",
    "V, B/W split": "v-zb",
    "V, overlapped pairs": "dualpipev",
    "bidirectional": "bitpipe",
}

COLUMNS = (
    "recompute full",
    "recompute selective",
    "bf16",
    "SP, TP=2",
    "uneven layout",
    "HybridModel",
    "MoE EP=1",
    "MoE EP=2",
    "distributed optimizer",
    "FSDP",
    "post-validation",
    "checkpoint interchange",
)


@dataclass(frozen=True)
class Verify:
    """``verify_schedule(schedule, pool, **options)``; ``model``: fields of ``TinyGPTSpec``."""

    options: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PostValidated:
    """Post-validation against megatron's synchronous step, a rollback forced by an inf on stage 1."""


@dataclass(frozen=True)
class Covered:
    """A test elsewhere: ``path::function`` (optionally ``[parameter id]``)."""

    test: str


@dataclass(frozen=True)
class Refused:
    """``pretrain_gpt.py`` flags that stop with one line naming ``flag`` (exit 2, no process group)."""

    argv: tuple[str, ...]
    flag: str


Cell = Verify | PostValidated | Covered | Refused

_BY_COLUMN: dict[str, Cell] = {
    "recompute full": Verify(model={"recompute": "full"}),
    "recompute selective": Verify(model={"recompute": "selective"}),
    "SP, TP=2": Verify(options={"tp": 2, "sequence_parallel": True}),
    "distributed optimizer": Verify(options={"dp": 2, "distributed_optimizer": True}),
    "FSDP": Verify(options={"fsdp": True}, model={"tied_embeddings": False}),
    "post-validation": PostValidated(),
}

_CHECKPOINT = "tests/integration/test_checkpoint_reload.py::test_checkpoint_loads_exactly_or_is_refused"
_BF16 = "tests/integration/test_compat_pretrain.py::test_bf16_losses_equal_megatrons_1f1b"

CELLS: dict[tuple[str, str], Cell] = {(row, col): cell for row in ROWS for col, cell in _BY_COLUMN.items()}
CELLS.update(
    {
        ("loop, 1F1B", "checkpoint interchange"): Covered(f"{_CHECKPOINT}[torch_dist-v-half]"),
        ("loop, interleaved", "checkpoint interchange"): Covered(f"{_CHECKPOINT}[torch_dist-interleaved-1f1b]"),
        ("loop, B/W split", "checkpoint interchange"): Covered(f"{_CHECKPOINT}[torch-zb-h1]"),
        ("V, B/W split", "checkpoint interchange"): Covered(f"{_CHECKPOINT}[torch_dist-v-zb]"),
        ("V, overlapped pairs", "checkpoint interchange"): Covered(f"{_CHECKPOINT}[torch_dist-dualpipev]"),
        ("bidirectional", "checkpoint interchange"): Covered(
            "tests/integration/test_bitpipe_checkpoint.py::test_checkpoint_resumes_under_the_other_schedule[bitpipe]"
        ),
    }
)
CELLS.update({(row, "bf16"): Covered(f"{_BF16}[{schedule}]") for row, schedule in ROWS.items()})

MARK = {Verify: "✔", PostValidated: "✔", Covered: "✔", Refused: "refused"}


def render() -> str:
    """The README's table (markdown)."""
    lines = ["| family (schedule) | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for row, schedule in ROWS.items():
        marks = [MARK[type(CELLS[row, col])] if (row, col) in CELLS else "?" for col in COLUMNS]
        lines.append(f"| {row} (`{schedule}`) | " + " | ".join(marks) + " |")
    return "\n".join(lines)
