"""The compatibility matrix's cells that run here (``tests/compat_matrix.py``): verify and post-validation runs.

Each :class:`Verify` cell runs the family's schedule with the feature on against the float64 and megatron fp32
references (the derived verdict); each :class:`PostValidated` cell steps the schedule with post-validation and
with megatron's synchronous step on the same ranks, an inf injected on stage 1 in the second iteration forcing
a rollback, and wants the weights bitwise equal. One rank pool (the session's) runs them all; references are
shared by the cells of one model (the pool's cache).
"""

from __future__ import annotations

import pytest

from megatron_pp_ext.schedules import generate
from megatron_pp_ext.verification.post_validation_check import compare_weights, run_pair
from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec
from megatron_pp_ext.verification.verify import verify_schedule
from tests.compat_matrix import CELLS, ROWS, M, P, PostValidated, Refused, Verify


def _cells(kind: type) -> list[object]:
    return [pytest.param(row, col, id=f"{ROWS[row]}-{col.replace(' ', '_')}") for (row, col), cell in CELLS.items()
            if isinstance(cell, kind)]  # fmt: skip


@pytest.mark.parametrize(("row", "column"), _cells(Verify))
def test_verify_cell(pool, row, column):
    cell = CELLS[row, column]
    assert isinstance(cell, Verify)
    schedule = generate(ROWS[row], P, M)
    model = TinyGPTSpec(**{"num_layers": schedule.placement.stages_per_replica, **cell.model})
    report = verify_schedule(schedule, pool, model=model, iterations=2, trace=False, **cell.options)
    assert report.problems == [], report
    assert report.ok, report


@pytest.mark.parametrize(("row", "column"), _cells(PostValidated))
def test_post_validation_cell(pool, row, column):
    schedule = generate(ROWS[row], P, M)
    model = TinyGPTSpec(num_layers=schedule.placement.stages_per_replica)
    sync, post = run_pair(schedule, pool, inject_inf=((1, 1),), model=model)
    report = compare_weights(schedule.name, sync, post)
    assert report.ok and report.bitwise_equal, report
    assert report.rollbacks > 0, report  # the forced rollback happened: the cell tested the rollback path


@pytest.mark.parametrize(("row", "column"), _cells(Refused))
def test_refused_cell(capsys, row, column):
    from megatron_pp_ext.cli.main import main

    cell = CELLS[row, column]
    assert isinstance(cell, Refused)
    assert main(["verify", ROWS[row], "-p", str(P), "-m", str(M), *cell.argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    for word in cell.words:
        assert word in err, err
