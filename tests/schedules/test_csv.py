"""CSV round trip of every registered schedule and loading hand-written files."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_pp_ext.schedules import (
    BW,
    F,
    Schedule,
    ScheduleError,
    ScheduleSyntaxError,
    generate,
    loop_placement,
    names,
)

CASES = [(1, 1, None), (2, 4, None), (4, 8, None), (4, 8, 2), (3, 9, 3), (4, 5, None), (8, 16, None)]


def _generated() -> list[Schedule]:
    out = []
    for name in names():
        for p, m, v in CASES:
            try:
                out.append(generate(name, p, m, v=v))
            except ScheduleError:
                continue
    return out


def test_every_registered_schedule_has_a_round_trip_case() -> None:
    built = {s.name for s in _generated()}
    assert built == set(names())


@pytest.mark.parametrize("schedule", _generated(), ids=lambda s: f"{s.name}-p{s.num_ranks}-m{s.num_microbatches}")
def test_csv_round_trip(schedule: Schedule, tmp_path: Path) -> None:
    text = schedule.to_csv()
    again = Schedule.from_csv(text)
    assert again == schedule
    assert again.to_csv() == text
    path = tmp_path / "s.csv"
    schedule.save(path)
    assert Schedule.load(path) == schedule


USER_CSV = """\
# my hand-written interleaved schedule
# placement=loop
# chunks=2
0,F0.0,F0.1,F2.0,F2.1,BW2.0,BW2.1,BW0.0,BW0.1
1,F1.0,F1.1,F3.0,BW3.0,F3.1,BW3.1,BW1.0,BW1.1
"""


def test_user_csv_short_headers(tmp_path: Path) -> None:
    path = tmp_path / "mine.csv"
    path.write_text(USER_CSV)
    schedule = Schedule.load(path)
    assert schedule.placement == loop_placement(2, 2)
    assert schedule.num_microbatches == 2  # from the largest micro-batch index
    assert schedule.name == "mine"  # file stem when there is no name header
    assert schedule.ops[1][:3] == (F(1, 0), F(1, 1), F(3, 0))
    assert schedule.ops[0][-1] == BW(0, 1)
    # the hand-written file is megatron's interleaved order for p=2, m=2, v=2
    assert schedule.ops == generate("interleaved-1f1b", 2, 2, v=2).ops


def test_user_csv_defaults_to_one_chunk_loop() -> None:
    schedule = Schedule.from_csv("0,F0.0,BW0.0\n\n1,F1.0,BW1.0\n")
    assert schedule.placement == loop_placement(2)
    assert schedule.name == "custom"


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("# placement=loop\n", "no rank rows"),
        ("x,F0.0\n", "first cell must be the rank"),
        ("0,F0.0\n0,F0.1\n", "rank 0 has two rows"),
        ("0,F0.0\n2,F2.0\n", r"no row for rank\(s\) \[1\]"),
        ("0,F0.0,G0.1\n", r"<csv>:1 \(rank 0\): cannot parse op 'G0.1'"),
        ("# chunks=two\n0,F0.0\n", "chunks must be an integer"),
        ("# placement=spiral\n0,F0.0\n", "unknown placement style"),
        ("# microbatches=many\n0,F0.0\n", "bad header value"),
    ],
)
def test_bad_csv(text: str, match: str) -> None:
    with pytest.raises(ScheduleError, match=match):
        Schedule.from_csv(text)


def test_missing_file_is_a_syntax_error(tmp_path: Path) -> None:
    with pytest.raises(ScheduleSyntaxError, match="cannot read schedule file"):
        Schedule.load(tmp_path / "nope.csv")


def test_a_byte_order_mark_is_accepted(tmp_path: Path) -> None:
    """Spreadsheet programs save CSV as UTF-8 with a byte-order mark before the first cell."""
    schedule = generate("zb-h1", 2, 4)
    path = tmp_path / "saved_by_a_spreadsheet.csv"
    path.write_bytes(b"\xef\xbb\xbf" + schedule.to_csv().encode())
    assert Schedule.load(path).to_csv() == schedule.to_csv()
    assert Schedule.from_csv("\ufeff" + schedule.to_csv()).to_csv() == schedule.to_csv()
