"""The GPU check's logic on CPU (``scripts/gpu_check.sh --dry-run``), so that a broken script is caught before
a GPU machine is spent on it: arguments, one line per check, time limits, the JSON summary and the comparison
with the planner. The pipeline check's dry run is in tests/selfcheck/test_gpu_pipeline_check.py (it shares the
runtime tests' rank pool)."""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_pp_ext.planner.cost_model import CostModel, get_device
from megatron_pp_ext.planner.memory import TrainingSetup
from megatron_pp_ext.planner.models import get_model
from megatron_pp_ext.selfcheck import gpu_check
from megatron_pp_ext.selfcheck.gpu_costs_check import compare_layer, device_preset

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def _script(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    env.pop("OUT", None)
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def _check_lines(stdout: str) -> dict[str, str]:
    lines = [line.split() for line in stdout.splitlines() if line.startswith(f"{gpu_check.PREFIX} ")]
    return {words[1]: words[2] for words in lines if words[2] in {s.upper() for s in gpu_check.STATUSES}}


@pytest.mark.gloo  # the split check runs one-rank gloo groups in the script's process
def test_dry_run_of_the_layer_checks(tmp_path):
    checks = "split-local,costs,memory,split-te"
    done = _script("--dry-run", "--in-process", "--checks", checks, "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert _check_lines(done.stdout) == {"split-local": "PASS", "costs": "PASS", "memory": "PASS", "split-te": "SKIP"}
    summary = json.loads((tmp_path / gpu_check.SUMMARY_FILE).read_text())
    assert summary["ok"] and summary["dry_run"] and summary["megatron-core"] == "0.19.2"
    results = {c["name"]: c for c in summary["checks"]}
    assert list(results) == checks.split(",")
    layer = results["split-local"]["details"]["transformer_layer"]
    assert layer["b_computed"] == [] and layer["w_missed"] == [] and layer["grad_guard"] == []
    assert layer["verdict_ok"] and min(layer["closures_per_b"]) >= 4, layer["verdict"]
    for linear in results["split-local"]["details"]["linears"].values():
        assert linear["bitwise"] and linear["b_computed"] == [] and linear["w_missed"] == []
    for shape in results["costs"]["details"]["shapes"].values():
        measured = shape["measured_s"]
        assert all(measured[op] > 0 for op in ("f", "b", "w", "bw"))
        assert shape["calibrated_efficiency"] > 0
        # what the store holds between B and W is what the memory model counts (the local spec's linears)
        assert shape["w_store_ratio"] == pytest.approx(1.0, rel=0.02)
    assert results["memory"]["details"]["predicted_bytes"] > 0


@pytest.mark.slow
def test_each_check_is_time_boxed_and_the_others_still_run(tmp_path):
    """Both checks killed at their limit (with their process group), both reported, the summary written."""
    done = _script("--dry-run", "--checks", "split-local,costs", "--check-timeout", "0.3", "--out", str(tmp_path))
    assert done.returncode == 1
    assert _check_lines(done.stdout) == {"split-local": "TIMEOUT", "costs": "TIMEOUT"}
    summary = json.loads((tmp_path / gpu_check.SUMMARY_FILE).read_text())
    assert not summary["ok"]
    assert [(c["name"], c["status"]) for c in summary["checks"]] == [("split-local", "timeout"), ("costs", "timeout")]
    assert all("killed" in c["summary"] and c["seconds"] < 20 for c in summary["checks"])


def test_checks_past_the_budget_are_reported_not_started(tmp_path, capsys):
    assert gpu_check.main(["--dry-run", "--checks", "costs,memory", "--budget", "1", "--out", str(tmp_path)]) == 1
    summary = json.loads((tmp_path / gpu_check.SUMMARY_FILE).read_text())
    assert [c["status"] for c in summary["checks"]] == ["timeout", "timeout"]
    assert all("not started" in c["summary"] for c in summary["checks"])
    assert _check_lines(capsys.readouterr().out) == {"costs": "TIMEOUT", "memory": "TIMEOUT"}


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--dry-run", "--checks", "nope"], "--checks"),
        (["--dry-run", "--checks", ""], "--checks"),
        (["--dry-run", "--budget", "0"], "--budget"),
        (["--dry-run", "--check-timeout", "nan"], "--check-timeout"),
        (["--in-process"], "--in-process"),
    ],
)
def test_bad_arguments_name_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as info:
        gpu_check.main(argv)
    assert info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert len(errors) == 1 and flag in errors[0], errors


def test_without_a_gpu_it_says_so(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    with pytest.raises(SystemExit):
        gpu_check.main(["--checks", "costs"])
    assert "no CUDA device visible" in capsys.readouterr().err


def test_calibration_recovers_the_efficiency_the_times_came_from():
    model, preset = get_model("zb-1.5b"), get_device("H100-80GB")
    cost = CostModel(model=model, device=preset, setup=TrainingSetup(precision="bf16", sequence_parallel=False))
    times = replace(cost, efficiency=0.4).layer_times(6, 1, "none")
    measured = {"f": times.f, "b": times.b, "w": times.w, "bw": times.b + times.w, "held": 1.0}
    result = compare_layer(model, preset, 6, measured)
    assert result["calibrated_efficiency"] == pytest.approx(0.4, rel=1e-9)
    assert result["within_target"] and result["deferral_overhead"] == pytest.approx(0.0)
    skewed = {**measured, "w": 2 * times.w}  # W twice what the FLOPs say: no single efficiency fits all three
    assert not compare_layer(model, preset, 6, skewed)["within_target"]


def test_device_names_map_to_planner_presets():
    assert device_preset("NVIDIA H100 80GB HBM3").name == "H100-80GB"
    assert device_preset("NVIDIA H200").name == "H200"
    assert device_preset("cpu").name == "CPU"


@pytest.mark.gloo  # a one-rank gloo group in the script's process
def test_dry_run_of_the_moe_overlap_check(tmp_path):
    done = _script("--dry-run", "--in-process", "--checks", "moe-overlap", "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert _check_lines(done.stdout) == {"moe-overlap": "PASS"}
    check = json.loads((tmp_path / gpu_check.SUMMARY_FILE).read_text())["checks"][0]
    pair = check["details"]["pair_nodes"]
    on_comm = {(name, side) for name, side, stream in pair if stream == "comm"}
    assert on_comm == {(n, s) for n in ("moe_dispatch", "moe_combine") for s in "FB"}
    assert all(stream == "comp" for name, _, stream in pair if name not in ("moe_dispatch", "moe_combine"))
    assert check["details"]["loss_diff"] == 0.0 and check["details"]["max_rel_grad_diff"] < 1e-5
