"""plan -> launch -> collect on this machine: two planned configurations of the tiny model on two
CPU processes (pipeline size 2, gloo) run a few iterations of megatron's own training loop through
scripts/pretrain_gpt.py, and `collect` turns their logs into the table. ~1 minute."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from megatron_pp_ext.cli import main
from megatron_pp_ext.planner.collect import collect
from megatron_pp_ext.planner.grid import DEFAULT_SCRIPT

pytestmark = [
    pytest.mark.gloo,
    pytest.mark.skipif(
        importlib.util.find_spec("torch") is None or importlib.util.find_spec("megatron.training") is None,
        reason="needs torch and megatron-core",
    ),
    pytest.mark.skipif(not DEFAULT_SCRIPT.exists(), reason="scripts/pretrain_gpt.py missing"),
]


def test_local_launcher_runs_two_planned_configurations_and_collects(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "local"
    code = main(
        [
            "launch-local",
            "--out",
            str(out),
            "--schedules",
            "1f1b,interleaved-1f1b",
            "--best-per-schedule",
            "--top",
            "2",
            "--train-iters",
            "3",
            "--timeout",
            "400",
            "--master-port",
            "29731",
            "--no-cache",
            "--collect",
        ]
    )
    printed = capsys.readouterr().out
    logs = out / "logs"
    plan = json.loads((out / "plan.json").read_text())
    assert plan["model"]["name"] == "tiny" and len(plan["rows"]) == 2
    assert all(r["pp"] == 2 for r in plan["rows"])
    tails = {p.name: p.read_text()[-3000:] for p in logs.glob("*.log")}
    assert code == 0, (printed, tails)
    table, _ = collect(logs, out / "plan.json", skip=1)
    assert len(table) == 2, table
    for row in table:
        # "exit-error": every iteration ran, then the process died at exit (seen intermittently on
        # this CPU setup: "terminate called without an active exception" after training).
        assert row["status"] in ("ok", "exit-error"), (row, tails)
        assert row["iterations"] == 3 and row["train_iters"] == 3
        assert row["iteration_ms_median"] > 0 and row["samples_per_second"] > 0
        assert row["predicted_iteration_ms"] > 0 and row["loss_last"] > 0
    assert {r["schedule"] for r in table} == {"1f1b", "interleaved-1f1b"}
    assert (logs / "results.md").exists() and (logs / "results.csv").exists()
    assert "| 1f1b-" in printed and ("| ok |" in printed or "| exit-error |" in printed)
