"""End to end: scripts/pretrain_gpt.py checkpoints save and reload across a schedule change (CPU, PP=2).

Each format megatron offers that runs on CPU (``torch``, ``torch_dist``): save after 2 iterations
under ``1f1b``, resume under ``zb-h1`` for a third. A checkpoint that cannot be read stops the
run with a non-zero status (megatron itself exits 0 there).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_megatron_pretrain import FLAGS, SCRIPT, free_port

ROOT = Path(__file__).resolve().parents[2]
FORMATS = ("torch", "torch_dist")


def run(tmp: Path, name: str, extra: list[str], timeout: float = 240) -> tuple[int, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    log = tmp / f"{name}.log"
    flags = [f for f in FLAGS]
    flags[flags.index("--train-iters") + 1] = "3"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    with log.open("w") as out:
        proc = subprocess.run(
            [*cmd, str(SCRIPT), *flags, *extra], cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout
        )
    return proc.returncode, log.read_text()


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A checkpoint at iteration 2 in each format, saved under 1f1b."""
    out: dict[str, Path] = {}
    for fmt in FORMATS:
        tmp = tmp_path_factory.mktemp(f"save_{fmt}")
        code, log = run(
            tmp,
            "save",
            ["--pipeline-schedule", "1f1b", "--ckpt-format", fmt, "--save", str(tmp / "ckpt"), "--save-interval", "2",
             "--exit-interval", "2"],
        )  # fmt: skip
        assert code == 0, log[-4000:]
        out[fmt] = tmp / "ckpt"
    return out


@pytest.mark.gloo
@pytest.mark.parametrize("fmt", FORMATS)
def test_checkpoint_reloads_under_another_schedule(tmp_path: Path, saved: dict[str, Path], fmt: str) -> None:
    code, log = run(tmp_path, "load", ["--pipeline-schedule", "zb-h1", "--ckpt-format", fmt, "--load", str(saved[fmt])])
    assert code == 0, log[-4000:]
    assert "successfully loaded checkpoint" in log, log[-4000:]
    assert "could not load" not in log
    iterations = [line for line in log.splitlines() if " iteration " in line and "lm loss" in line]
    assert len(iterations) == 1 and "iteration        3/" in iterations[0], iterations


@pytest.mark.gloo
def test_unreadable_checkpoint_exits_non_zero(tmp_path: Path, saved: dict[str, Path]) -> None:
    broken = tmp_path / "ckpt"
    shutil.copytree(saved["torch"], broken)
    for path in broken.rglob("*.pt"):
        path.write_bytes(b"not a checkpoint")
    code, log = run(tmp_path, "load", ["--pipeline-schedule", "1f1b", "--ckpt-format", "torch", "--load", str(broken)])
    assert code != 0, log[-4000:]
    assert f"could not load the checkpoint from {broken}" in log, log[-4000:]
