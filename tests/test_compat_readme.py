"""The README's compatibility matrix is the one ``tests/compat_matrix.py`` defines, and every cell has a test."""

from __future__ import annotations

import re
from pathlib import Path

from tests.compat_matrix import CELLS, COLUMNS, ROWS, Covered, render

ROOT = Path(__file__).resolve().parents[1]


def test_every_cell_is_defined():
    missing = [(row, col) for row in ROWS for col in COLUMNS if (row, col) not in CELLS]
    assert missing == []


def test_covered_cells_name_tests_that_exist():
    for (row, col), cell in CELLS.items():
        if not isinstance(cell, Covered):
            continue
        path, _, function = cell.test.partition("::")
        text = (ROOT / path).read_text()
        assert re.search(rf"^def {re.escape(function)}\(", text, re.M), (row, col, cell.test)
        param = cell.param
        if param:  # a literal parameter of the test, or a schedule of a test parametrized over the matrix rows
            assert f'"{param}"' in text or (param in ROWS.values() and "ROWS" in text), (row, col, cell.test)


def test_readme_table_is_the_matrix():
    readme = (ROOT / "README.md").read_text()
    assert render() in readme, "README's compatibility matrix is stale: paste tests.compat_matrix.render()"
