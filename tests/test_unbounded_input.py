"""Unbounded input and paths that used to end in a traceback: each is one error line, refused before the work.

Every refusal here comes from a bound checked before anything is sized by the request (the schedule's op
count, the bytes read, the planner's estimated search, the local rank processes), so these tests assert the
message and exit status, not a timing.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

import pytest

from megatron_pp_ext.cli import main
from megatron_pp_ext.planner import search
from megatron_pp_ext.planner.space import divisors
from megatron_pp_ext.schedules import limits
from megatron_pp_ext.schedules import schedule as schedule_module
from megatron_pp_ext.schedules.ir import ScheduleError
from megatron_pp_ext.schedules.schedule import Schedule


def outcome(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    """Exit status and stderr of a command (argparse's SystemExit included)."""
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code  # type: ignore[assignment]
    _, err = capsys.readouterr()
    assert "Traceback" not in err, err
    return int(code or 0), err


def one_error(capsys: pytest.CaptureFixture[str], *argv: str, code: int = 2) -> str:
    got, err = outcome(capsys, *argv)
    lines = [line for line in err.splitlines() if "error" in line.lower() or line.startswith(("INVALID", "megatron"))]
    assert got == code and len(lines) == 1, err
    return lines[0]


# ---- schedules too large to build or simulate ------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["-p", "4", "-m", "1000000000000000000"], "p=4 ranks x m=1000000000000000000 micro-batches x v=1 chunks"),
        (["-p", "100000", "-m", "100000"], "is 30,000,000,000 ops; the limit is 1,048,576 ops"),
        (["-p", "4", "-m", "100000000", "--iterations", "2"], "(-p x -m x -v) is 1,200,000,000 ops"),
    ],
)
def test_schedule_over_the_op_limit_is_refused(capsys: pytest.CaptureFixture[str], argv, expected) -> None:
    assert expected in one_error(capsys, "simulate", "1f1b", *argv)


def test_v_shape_counts_its_two_chunks(capsys: pytest.CaptureFixture[str]) -> None:
    assert "v=2 chunks" in one_error(capsys, "simulate", "v-half", "-p", "4", "-m", "100000000")


def test_compare_counts_every_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    """compare builds every registered schedule: -p 100000 -m 1 is within one schedule's limit, not all of them."""
    line = one_error(capsys, "compare", "-p", "100000", "-m", "1")
    assert "compare builds all" in line and "the limit is 1,048,576" in line


def test_iterations_times_ops_over_the_limit(capsys: pytest.CaptureFixture[str]) -> None:
    line = one_error(capsys, "simulate", "zb-h1", "-p", "4", "-m", "8", "--iterations", "1000000000")
    assert "1000000000 iterations (--iterations) x 96 ops" in line and "give at most --iterations 10922" in line


def test_the_limit_admits_every_published_configuration() -> None:
    """The largest configuration of scripts/slurm (p=32, m=256, v=1; 24,576 ops) with room to spare."""
    limits.check_ops(32, 256, 1)
    limits.check_ops(64, 2048, 2)  # 786,432 ops
    with pytest.raises(limits.ScheduleTooLargeError):
        limits.check_ops(64, 2048, 3)


# ---- schedule files without an end --------------------------------------------------------------------------
def test_dev_zero_is_binary_at_byte_zero(capsys: pytest.CaptureFixture[str]) -> None:
    line = one_error(capsys, "validate", "/dev/zero", code=1)
    assert "not a text (UTF-8) schedule: binary data at byte 0" in line


def test_endless_text_from_a_pipe_stops_at_the_byte_cap(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A FIFO reports size 0: the cap must be counted while reading (it trusted ``st_size`` before)."""
    monkeypatch.setattr(schedule_module, "MAX_FILE_BYTES", 1 << 20)
    fifo = tmp_path / "endless.csv"
    os.mkfifo(fifo)
    stop = threading.Event()

    def write_forever() -> None:
        try:
            with open(fifo, "w") as stream:
                while not stop.is_set():
                    stream.write("0,F0.0,B0.0\n" * 1000)
        except (BrokenPipeError, OSError):
            pass

    writer = threading.Thread(target=write_forever, daemon=True)
    writer.start()
    try:
        with pytest.raises(ScheduleError, match=r"has more than 1048576 bytes"):
            Schedule.load(fifo)
    finally:
        stop.set()
    writer.join(timeout=10)


def test_a_file_with_more_ops_than_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(schedule_module, "MAX_OPS", 10)
    with pytest.raises(ScheduleError, match=r"more than 10 ops, the limit of a schedule"):
        Schedule.from_csv("0," + ",".join(f"F{i}.0" for i in range(11)) + "\n")


# ---- the planner ----------------------------------------------------------------------------------------------
def test_divisors_pairs_up_to_the_square_root() -> None:
    for n in range(1, 500):
        assert divisors(n) == [k for k in range(1, n + 1) if n % k == 0]
    assert divisors(1 << 20)[-1] == 1 << 20 and len(divisors(1 << 20)) == 21


@pytest.fixture
def no_search(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if a schedule is built: these refusals come before the search."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the search started")

    monkeypatch.setattr(search.Planner, "build", refuse)


def test_large_global_batch_is_refused_before_the_search(capsys: pytest.CaptureFixture[str], no_search) -> None:
    """zeropp's unit sizes (every divisor of m) at PP 16 and 8 make most of a large search: refused, naming the
    flags that narrow it."""
    line = one_error(capsys, "plan", "--model", "zb-6.2b", "--gpus", "16", "--global-batch", "2048", "--no-cache")
    assert "the search would cost about" in line and f"the limit is {search.MAX_SEARCH_OPS:,}" in line
    assert "--unit-sizes" in line


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--global-batch", "1000000000000"], "argument --global-batch: must be an integer in [1, 1,048,576]"),
        (["--gpus", "1000000000000"], "argument --gpus: must be an integer in [1, 1,048,576]"),
        (["--top", "-1"], "argument --top: must be an integer >= 0, got '-1'"),
        (["--gpus", "1000000"], "no configuration of 1000000 GPUs fits global batch 8: TP x PP x DP must be"),
    ],
)
def test_planner_flags_out_of_range(capsys: pytest.CaptureFixture[str], no_search, argv, expected) -> None:
    assert expected in one_error(capsys, "plan", "--model", "tiny", *argv)


def test_save_path_is_checked_before_the_search(capsys, tmp_path: Path, no_search) -> None:
    missing = tmp_path / "no" / "plan.json"
    assert "folder " + str(missing.parent) + " does not exist" in one_error(
        capsys, "plan", "--model", "tiny", "--save", str(missing)
    )
    assert f"{tmp_path} is a directory, not a file" in one_error(
        capsys, "plan", "--model", "tiny", "--save", str(tmp_path)
    )


def test_nothing_fits_exits_non_zero_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    line = one_error(capsys, "plan", "--model", "tiny", "--memory-budget", "0.001", "--memory-reserve", "0", code=1)
    assert "no configuration fits:" in line and "over the memory budget" in line


@pytest.mark.parametrize("command", ["launch-local", "collect"])
def test_out_onto_an_existing_file(capsys: pytest.CaptureFixture[str], tmp_path: Path, command: str) -> None:
    target = tmp_path / "afile"
    target.write_text("")
    first = ["--dry-run"] if command == "launch-local" else [str(tmp_path)]
    assert f"argument --out: {target} exists and is not a directory" in one_error(
        capsys, command, *first, "--out", str(target)
    )


def test_launch_local_top_minus_one(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """--top -1 was a Python slice: every configuration but the last (71 runs)."""
    line = one_error(capsys, "launch-local", "--out", str(tmp_path / "o"), "--top", "-1", "--dry-run")
    assert "argument --top: must be an integer >= 0" in line


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[1]", "is not a megatron-pp plan (format 'list'"),
        ('{"format": "megatron-pp plan v1", "rows": [1]}', "row 0 is not a configuration"),
        ('{"format": "megatron-pp plan v1"}', "is not a megatron-pp plan"),
        ("{", "cannot read plan"),
    ],
)
def test_malformed_plan_for_the_launcher(capsys, tmp_path: Path, text: str, expected: str) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(text)
    line = one_error(capsys, "launch-local", "--plan", str(plan), "--out", str(tmp_path / "o"), "--dry-run")
    assert expected in line


# ---- collect -------------------------------------------------------------------------------------------------------
def test_collect_names_a_dangling_log_link(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "x.log").symlink_to(tmp_path / "gone.log")
    line = one_error(capsys, "collect", str(tmp_path), "--no-plot")
    assert f"cannot read log {tmp_path / 'x.log'}: a dangling symbolic link" in line


def test_collect_skips_a_folder_named_like_a_log(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "x.log").mkdir()
    assert f"no *.log files under {tmp_path}" in one_error(capsys, "collect", str(tmp_path), "--no-plot")


def test_collect_plan_read_with_a_cap(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "a.log").write_text("")
    line = one_error(capsys, "collect", str(tmp_path), "--plan", "/dev/zero", "--no-plot")
    assert "cannot read plan /dev/zero" in line and "MiB" in line


# ---- verify -----------------------------------------------------------------------------------------------------
def test_verify_refuses_more_ranks_than_the_machine_takes(capsys: pytest.CaptureFixture[str]) -> None:
    line = one_error(capsys, "verify", "1f1b", "-p", "1000", "-m", "1")
    assert "-p 1000 x --tp 1 x --dp 1 needs 1000 local rank processes; this machine takes at most" in line


def test_plan_json_keys_unchanged_by_the_checks(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A plan saved to a checked path is still the document the launchers read."""
    path = tmp_path / "plan.json"
    assert outcome(capsys, "plan", "--model", "tiny", "--pp", "2", "--schedules", "1f1b", "--save", str(path))[0] == 0
    assert json.loads(path.read_text())["format"] == "megatron-pp plan v1"


def test_save_to_a_device_or_a_full_disk_is_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device passes the folder checks (``/dev/full``: writable, and every write fails with ENOSPC): refused
    when the command line is read; a disk that fills during the write is one line naming --save and the file."""
    if os.path.exists("/dev/full"):
        assert "/dev/full is not a regular file" in one_error(capsys, "plan", "--model", "tiny", "--save", "/dev/full")
    import errno

    def full(self: Path, *args: object, **kwargs: object) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))

    monkeypatch.setattr(Path, "write_text", full)
    path = tmp_path / "plan.json"
    line = one_error(capsys, "plan", "--model", "tiny", "--pp", "2", "--schedules", "1f1b", "--save", str(path))
    assert f"argument --save: cannot write {path}: No space left on device" in line


def test_draw_refuses_charts_over_its_limit(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """draw's own bound (a chart costs far more per op than a simulation): one line with the count and limit."""
    monkeypatch.setattr(limits, "MAX_DRAWN_OPS", 20)
    line = one_error(capsys, "draw", "zb-h1", "-p", "2", "-m", "4", "-o", str(tmp_path / "x.png"))
    assert "the schedule has 24 ops; draw charts at most 20" in line
    assert not (tmp_path / "x.png").exists()
