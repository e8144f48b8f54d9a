"""Out-of-range command-line input: one error line naming the flag and its range, non-zero exit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from megatron_pp_ext.cli import main

DATA = Path(__file__).parents[1] / "planner" / "data"


def error_of(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run the command; it must fail (argparse's SystemExit(2) or a return code 2) with one error line."""
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code  # type: ignore[assignment]
    _, err = capsys.readouterr()
    assert code == 2, err
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["plan", "--model", "tiny", "--gpus", "0"], "argument --gpus: must be an integer in [1, 1,048,576]"),
        (["plan", "--model", "tiny", "--global-batch", "0"], "argument --global-batch: must be an integer in [1, "),
        (["plan", "--model", "tiny", "--memory-budget", "nan"], "argument --memory-budget: must be a finite number"),
        (["plan", "--model", "tiny", "--efficiency", "0"], "argument --efficiency: must be a finite number in (0, 1]"),
        (["plan", "--model", "tiny", "--dp-overlap", "2"], "argument --dp-overlap: must be a finite number in [0, 1]"),
        (["verify", "1f1b", "-p", "2", "-m", "2", "--timeout", "0"], "--timeout: must be a finite number in (0"),
        (["verify", "1f1b", "-p", "2", "-m", "2", "--tolerance", "-1"], "--tolerance: must be a finite number"),
        (["simulate", "zb-auto", "-p", "4", "-m", "8", "--costs", "1e308,1e308,1e308,1e308"], "must be finite numbers"),
        (["launch-local", "--out", "unused", "--timeout", "0"], "argument --timeout: must be a finite number in (0"),
        (["simulate", "1f1b", "-p", "4", "-m", "8", "--costs", "1,nan,1"], "must be finite numbers in [0, 1e+12]"),
    ],
)
def test_out_of_range_values(capsys: pytest.CaptureFixture[str], argv: list[str], expected: str) -> None:
    assert expected in error_of(capsys, *argv)


def test_grid_out_must_be_a_directory(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    target = tmp_path / "afile"
    target.write_text("")
    message = error_of(capsys, "grid", "--slurm", "--out", str(target), "--model", "tiny", "--gpus", "2")
    assert f"argument --out: {target} exists and is not a directory" in message


@pytest.mark.parametrize(
    ("plan", "expected"),
    [
        ([1, 2], "top level is a list, not an object"),
        ({"rows": [1]}, "row 0 is not an object with an 'id'"),
        ({"rows": {"a": 1}}, "'rows' is a dict, not a list"),
        (
            {"rows": [{"id": "zb-h1-t1p8d1-b3m32-v1-none", "iteration_time_s": "fast"}]},
            "row 0 (zb-h1-t1p8d1-b3m32-v1-none): iteration_time_s is 'fast'",
        ),
    ],
)
def test_collect_with_a_malformed_plan(capsys: pytest.CaptureFixture[str], tmp_path: Path, plan, expected) -> None:
    logs = tmp_path / "logs"
    shutil.copytree(DATA, logs)
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(json.dumps(plan))
    message = error_of(capsys, "collect", str(logs), "--plan", str(plan_file), "--out", str(tmp_path / "out"))
    assert f"plan {plan_file}: {expected}" in message


@pytest.mark.parametrize("value", ["abc", "0", "nan"])
def test_bad_timeout_variable_names_it(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    from megatron_pp_ext.runtime import agreement

    monkeypatch.setenv("MEGATRON_PP_AGREE_TIMEOUT", value)
    with pytest.raises(ValueError, match=rf"MEGATRON_PP_AGREE_TIMEOUT='{value}': expected a number of seconds > 0"):
        agreement.agree_timeout_s()
