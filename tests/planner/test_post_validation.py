"""`plan --post-validation` and `plan --w-memory auto`: the planner times an iteration with the
simulator's back-to-back notion and hands zb-auto the span objective and the derived W share."""

from __future__ import annotations

import pytest

from megatron_pp_ext.cli import main

BASE = ["plan", "--model", "zb-1.5b", "--gpus", "8", "--global-batch", "144", "--tp", "1", "--pp", "8",
        "--micro-batch", "6", "--recompute", "none", "--attention", "unfused", "--schedules", "zb-h2,zb-auto",
        "--schedule-memory-limits", "2p", "--best-per-schedule", "--no-cache", "--no-progress"]  # fmt: skip


def iteration_times(capsys: pytest.CaptureFixture[str], *extra: str) -> dict[str, float]:
    assert main([*BASE, *extra]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line[:1].isdigit()]
    return {row[1]: float(row[9]) for row in rows}  # schedule -> iteration seconds


def test_post_validation_shortens_zb_iterations(capsys: pytest.CaptureFixture[str]) -> None:
    sync = iteration_times(capsys, "--w-memory", "auto")
    pv = iteration_times(capsys, "--w-memory", "auto", "--post-validation")
    assert pv["zb-h2"] < sync["zb-h2"]  # its (p-1) T_F ramp overlaps the next iteration
    assert pv["zb-auto@2p"] <= pv["zb-h2"] and pv["zb-auto@2p"] <= sync["zb-auto@2p"]


def test_w_memory_flag_bounds(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("0", "1.5", "half"):
        with pytest.raises(SystemExit) as exc:
            main([*BASE, "--w-memory", bad])
        assert exc.value.code == 2
        assert "--w-memory" in capsys.readouterr().err.strip().splitlines()[-1]
