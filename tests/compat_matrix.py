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

The cells run at ``p = 2``, ``m = 4``; MoE with 4 experts, top-2; the uneven split gives the first model stage one
of 7 layers (``--decoder-first-pipeline-num-layers 1``).

No cell may be missing: ``tests/test_compat_readme.py`` checks that every row has every column and that the
README's table is :func:`render`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from megatron_pp_ext.schedules.layer_split import LayerSplit

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
    """A test elsewhere: ``path::function``, run with the parameter ``param`` (a literal of that file, or the row's
    schedule for a test parametrized over :data:`ROWS`)."""

    test: str
    param: str | None = None


@dataclass(frozen=True)
class Refused:
    """``megatron-pp verify SCHEDULE -p 2 -m 4 ARGV`` stops with one line containing ``words`` (exit 2, before any
    rank starts); the training flags go through the same check (``docs/uneven.md``, ``docs/moe.md``)."""

    argv: tuple[str, ...]
    words: tuple[str, ...]


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
        ("loop, 1F1B", "checkpoint interchange"): Covered(_CHECKPOINT, "torch_dist-v-half"),
        ("loop, interleaved", "checkpoint interchange"): Covered(_CHECKPOINT, "torch_dist-interleaved-1f1b"),
        ("loop, B/W split", "checkpoint interchange"): Covered(_CHECKPOINT, "torch-zb-h1"),
        ("V, B/W split", "checkpoint interchange"): Covered(_CHECKPOINT, "torch_dist-v-zb"),
        ("V, overlapped pairs", "checkpoint interchange"): Covered(_CHECKPOINT, "torch_dist-dualpipev"),
        ("bidirectional", "checkpoint interchange"): Covered(
            "tests/integration/test_bitpipe_checkpoint.py::test_checkpoint_resumes_under_the_other_schedule", "bitpipe"
        ),
    }
)
CELLS.update({(row, "bf16"): Covered(_BF16, schedule) for row, schedule in ROWS.items()})
_HYBRID = "tests/verification/test_verify_hybrid.py::test_hybrid_model_matches_references"
CELLS.update({(row, "HybridModel"): Covered(_HYBRID, schedule) for row, schedule in ROWS.items()})
# the same runs as these cells (P x DP = 2 x 2, M = 4, megatron's distributed optimizer), collectives checked too
_DATA_PARALLEL = "tests/verification/test_verify_data_parallel.py::test_data_parallel_matches_reference"
CELLS.update(
    {
        (row, "distributed optimizer"): Covered(_DATA_PARALLEL, ROWS[row])
        for row in ("loop, interleaved", "loop, B/W split", "bidirectional")
    }
)

_MOE = {"num_experts": 4, "moe_topk": 2}
_MOE_TESTS = "tests/verification/test_verify_moe.py"
_MOE_COVERED = {
    1: (("1f1b", "zb-h1"), "test_moe_without_expert_parallelism"),
    2: (("1f1b", "zb-h1", "v-zb", "dualpipev"), "test_moe_with_expert_parallelism"),
}
for _ep, (_covered, _test) in _MOE_COVERED.items():
    for _row, _schedule in ROWS.items():
        CELLS[_row, f"MoE EP={_ep}"] = (
            Covered(f"{_MOE_TESTS}::{_test}", _schedule)
            if _schedule in _covered
            else Verify(options={"dp": _ep, "ep": _ep}, model=_MOE)
        )

_UNEVEN_MODEL = {"num_layers": 7, "split": LayerSplit(first=1)}
_UNEVEN = "tests/verification/test_verify_uneven.py::"
CELLS.update(
    {
        ("loop, 1F1B", "uneven layout"): Covered(f"{_UNEVEN}test_megatron_1f1b_on_the_uneven_split"),
        ("loop, interleaved", "uneven layout"): Refused(
            ("--num-layers", "8", "--decoder-first-pipeline-num-layers", "2"),
            ("argument --decoder-first-pipeline-num-layers:", "interleaved chunks per rank"),
        ),
        ("loop, B/W split", "uneven layout"): Covered(f"{_UNEVEN}test_split_schedules_on_the_uneven_split", "zb-h1"),
        ("V, B/W split", "uneven layout"): Covered(f"{_UNEVEN}test_split_schedules_on_the_uneven_split", "v-zb"),
        ("V, overlapped pairs", "uneven layout"): Verify(model=_UNEVEN_MODEL),
        ("bidirectional", "uneven layout"): Covered(f"{_UNEVEN}test_bidirectional_placement_on_a_layout_string"),
    }
)

MARK = {Verify: "✔", PostValidated: "✔", Covered: "✔", Refused: "refused"}


def render() -> str:
    """The README's table (markdown)."""
    lines = ["| family (schedule) | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for row, schedule in ROWS.items():
        marks = [MARK[type(CELLS[row, col])] if (row, col) in CELLS else "?" for col in COLUMNS]
        lines.append(f"| {row} (`{schedule}`) | " + " | ".join(marks) + " |")
    return "\n".join(lines)
