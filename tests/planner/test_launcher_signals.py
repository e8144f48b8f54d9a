"""SIGTERM / SIGINT to ``launch-local`` stop its torchrun and every worker, and the launcher waits for them.

The runs are real torchrun launches (``--nproc-per-node 2``) of a stand-in driver script that records its pid
and sleeps, so the test sees exactly the processes a training run would leave behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.tiers import launches_ranks

ROOT = Path(__file__).resolve().parents[2]

DRIVER = """
import os, sys, time
open(os.path.join({pids!r}, str(os.getpid())), "w").close()
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) is not running
        with open(f"/proc/{pid}/stat") as stream:
            return stream.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@launches_ranks
def _launch(tmp_path: Path) -> tuple[subprocess.Popen[str], Path]:
    pids = tmp_path / "pids"
    pids.mkdir()
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER.format(pids=str(pids)))
    plan = {
        "format": "megatron-pp plan v1",
        "gpus": 2,
        "model_args": [],
        "precision_args": [],
        "rows": [{"id": "a", "megatron_args": []}, {"id": "b", "megatron_args": []}],
    }
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "megatron_pp_ext.cli", "launch-local", "--plan", str(tmp_path / "plan.json")]
    cmd += ["--out", str(tmp_path / "out"), "--script", str(driver), "--top", "0", "--master-port", "29731"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return proc, pids


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_signal_to_launch_local_stops_torchrun_and_workers(tmp_path: Path, sig: signal.Signals) -> None:
    proc, pids = _launch(tmp_path)
    deadline = time.monotonic() + 240  # torchrun imports torch before it starts the workers (slow when loaded)
    while len(list(pids.iterdir())) < 2:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the workers never started"
        time.sleep(0.2)
    workers = [int(p.name) for p in pids.iterdir()]
    groups = {os.getpgid(pid) for pid in workers}  # torchrun's group: cleaned up below if the check fails
    try:
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)  # the launcher waits for its children, within their grace
        end = time.monotonic() + 5
        while any(_alive(pid) for pid in workers) and time.monotonic() < end:
            time.sleep(0.1)
        assert not [pid for pid in workers if _alive(pid)], "workers outlived launch-local"
        assert proc.returncode == 128 + sig, err
        assert f"stopped by {sig.name}" in err and "Traceback" not in err, err
        assert not (tmp_path / "out" / "logs" / "b.log").exists()  # the next run did not start
    finally:
        for group in groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
