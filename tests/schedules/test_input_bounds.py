"""Schedule files with huge or negative numbers, gaps or binary data: one clear error, nothing allocated."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from megatron_pp_ext.cli import main
from megatron_pp_ext.schedules.ir import ScheduleError
from megatron_pp_ext.schedules.placement import make_placement
from megatron_pp_ext.schedules.schedule import Schedule

HEAD = "# megatron_pp_ext schedule v1\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (HEAD + "0,F0.999999999\n1,F1.0\n", r"microbatches=1000000000 out of range: must be 1\.\.2"),
        (HEAD + "# microbatches=1000000000\n0,F0.0,BW0.0\n1,F1.0,BW1.0\n", r"microbatches=1000000000 out of range"),
        (HEAD + "# microbatches=1\n0,F0.0,F0.999999999,BW0.0\n1,F1.0,BW1.0\n", r"F0\.999999999 out of range"),
        (HEAD + "# chunks=1000000000\n0,F0.0,BW0.0\n1,F1.0,BW1.0\n", r"chunks=1000000000 out of range: must be 1\.\.4"),
        (HEAD + "# microbatches=0\n0,F0.0,BW0.0\n1,F1.0,BW1.0\n", r"microbatches=0 out of range"),
        (HEAD + "# microbatches=1\n-1,F0.0\n0,F0.0,BW0.0\n1,F1.0,BW1.0\n", r":3: rank -1 out of range"),
    ],
)
def test_bad_numbers_fail_before_any_allocation(text: str, message: str) -> None:
    with pytest.raises(ScheduleError, match=message):
        Schedule.from_csv(text)


def test_huge_rank_gap_message_is_short() -> None:
    with pytest.raises(ScheduleError) as info:
        Schedule.from_csv("0,F0.0\n100000,F1.0\n")
    assert len(str(info.value)) < 200
    assert "no row for rank(s) [1, 2, 3, 4, 5, 6, 7, 8, 9, 10] ... (99999 in all)" in str(info.value)


def test_binary_file_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "weights.csv"
    path.write_bytes(b"0,F0.0\n\x89PNG\x00\xff\xfe")
    with pytest.raises(ScheduleError, match=rf"schedule file {path} is not a text \(UTF-8\) schedule"):
        Schedule.load(path)
    assert main(["validate", str(path)]) != 0
    captured = capsys.readouterr()
    assert str(path) in captured.out + captured.err


def test_validate_cli_rejects_rank_minus_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "neg.csv"
    path.write_text(HEAD + "# microbatches=1\n-1,F0.0\n0,F0.0,BW0.0\n1,F1.0,BW1.0\n")
    assert main(["validate", str(path)]) != 0
    captured = capsys.readouterr()
    assert "rank -1 out of range" in captured.out + captured.err


def test_placement_check_is_linear_in_p() -> None:
    """A bound on the work, read as this process's CPU time (other processes' load does not count).

    At p = 100000 a linear check does ~1e5 Python-level steps (well under a second on any CPU that runs
    torch); a quadratic one does ~1e10, which no CPython interpreter runs in under 30 s (it manages at
    most ~1e8 simple steps per second, so ~100 s or more). 30 s of CPU therefore separates the two on any
    machine, loaded or not."""
    start = time.process_time()
    placement = make_placement("loop", 100_000, 1)
    assert placement.num_ranks == 100_000
    assert time.process_time() - start < 30
