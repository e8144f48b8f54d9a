"""End to end: scripts/pretrain_gpt.py (megatron's training loop) at PP=2 on CPU, with and without the plugin.

``--pipeline-schedule 1f1b`` must reproduce megatron's own 1F1B bit for bit: the exact loss of
every micro-batch of every iteration (so also the gradients and the optimizer steps before
them) and megatron's logged loss and grad norm. The plugin run also forces the layer-placement
hooks on (they must not change anything for a loop placement). Both runs go concurrently.
"""

from __future__ import annotations

import re
import socket
import subprocess
from pathlib import Path
from typing import Any

import pytest
from warm_launch import launch as warm_launch
from warm_launch import run_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "pretrain_gpt.py"
ITERS = 3
FLAGS = [
    "--cpu",
    "--pipeline-model-parallel-size", "2",
    "--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "2", "--global-batch-size", "8",
    "--train-iters", str(ITERS), "--lr", "1e-3",
    "--eval-interval", "1000", "--eval-iters", "0", "--log-interval", "1", "--num-workers", "0",
]  # fmt: skip
LOG_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ .*lm loss: ([0-9.E+-]+) .*grad norm: ([0-9.]+)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(tmp: Path, name: str, extra: list[str], env_extra: dict[str, str]) -> tuple[Any, Path]:
    """``pretrain_gpt.py FLAGS EXTRA`` on two ranks through the warm launcher (tests/integration/warm_launch.py:
    real torchrun where the environment asks for it); every rank writes its losses to ``tmp/NAME.rank*``."""
    env = run_env(MEGATRON_PP_EXT_LOSS_FILE=str(tmp / name), **env_extra)
    return warm_launch(tmp, name, [*FLAGS, *extra], env=env)


def results(tmp: Path, name: str, log: Path) -> tuple[list[tuple[str, ...]], list[str]]:
    text = log.read_text()
    logged = [m.groups() for m in LOG_LINE.finditer(text)]
    files = sorted(tmp.glob(f"{name}.rank*"))
    assert len(files) == 1, f"{name}: expected one rank writing losses, got {files}\n{text[-3000:]}"
    return logged, files[0].read_text().split()


@pytest.mark.gloo
def test_plugin_1f1b_matches_megatron_bitwise(tmp_path: Path) -> None:
    runs = {
        "megatron": launch(tmp_path, "megatron", [], {}),
        "plugin": launch(tmp_path, "plugin", ["--pipeline-schedule", "1f1b"], {"MEGATRON_PP_EXT_LAYOUT_HOOKS": "1"}),
    }
    for name, (proc, log) in runs.items():
        try:
            code = proc.wait(timeout=240)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        assert code == 0, f"{name} run failed:\n{log.read_text()[-4000:]}"
    assert "pipeline schedule '1f1b' replaces megatron's" in runs["plugin"][1].read_text()
    logged_m, losses_m = results(tmp_path, "megatron", runs["megatron"][1])
    logged_p, losses_p = results(tmp_path, "plugin", runs["plugin"][1])
    assert [int(x[0]) for x in logged_m] == list(range(1, ITERS + 1))
    assert len(losses_m) == ITERS * 4  # 8 / 2 = 4 micro-batches per iteration
    values = [float.fromhex(x) for x in losses_m]
    assert all(v == v and abs(v) < float("inf") for v in values)
    assert losses_p == losses_m
    assert logged_p == logged_m
