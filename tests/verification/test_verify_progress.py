"""`megatron-pp verify` says what it is doing on stderr (ranks started, iteration k of n, comparison)
instead of ~20 s of silence, and megatron's Apex / Transformer Engine warnings do not flood it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.gloo
def test_verify_reports_progress_on_stderr() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "megatron_pp_ext.cli", "verify", "1f1b", "-p", "2", "-m", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    err = proc.stderr
    for line in (
        "megatron-pp verify: starting 2 rank process(es)",
        "megatron-pp verify: exact reference (float64): rank 0 of 1 started",
        "megatron-pp verify: megatron's fp32 reference: iteration 3 of 3",
        "megatron-pp verify: 1f1b on 2 ranks: rank 1 of 2 started",
        "megatron-pp verify: 1f1b on 2 ranks: iteration 1 of 3",
        "megatron-pp verify: megatron's own 1F1B on 2 ranks: iteration 3 of 3",
        "megatron-pp verify: comparing losses and every gradient with the references",
    ):
        assert line in err, err[-3000:]
    assert "Apex is not installed" not in err and "Transformer Engine and Apex" not in err, err[-3000:]
    assert proc.stdout.startswith("OK: 1f1b p=2 m=2"), proc.stdout
