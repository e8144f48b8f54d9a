"""End to end: megatron's own interleaved 1F1B with its combined 1F1B (``--overlap-moe-expert-parallel-comm``)
runs with scripts/pretrain_gpt.py on CPU (PP = 2 x VPP = 2 x EP = 2, bf16, 4 ranks): the driver's
``forward_step`` builds the schedule plan the combined step asks for, and CPU mode's communication stream
(integration/cpu_streams.py) hands megatron's pipeline callbacks finished tensors."""

from __future__ import annotations

import math
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from warm_launch import run_env

ROOT = Path(__file__).resolve().parents[2]
LOSS = re.compile(r"iteration\s+(\d+)/\s*3 .*lm loss: ([0-9.E+-]+)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.gloo
def test_megatron_interleaved_combined_1f1b_runs_with_the_driver(tmp_path: Path) -> None:
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
            str(_free_port()), str(ROOT / "scripts" / "pretrain_gpt.py"), "--cpu", "--bf16",
            "--overlap-moe-expert-parallel-comm",
            "--pipeline-model-parallel-size", "2", "--num-layers", "4", "--num-layers-per-virtual-pipeline-stage", "1",
            "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--train-iters", "3", "--lr", "1e-3", "--eval-iters", "0", "--log-interval", "1", "--num-workers", "0",
            "--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
            "--moe-token-dispatcher-type", "alltoall"]  # fmt: skip
    done = subprocess.run(argv, cwd=tmp_path, env=run_env(), capture_output=True, text=True, timeout=300)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-4000:]
    assert "schedule_plan" not in text and "AbstractSchedulePlan" not in text
    losses = LOSS.findall(text)
    assert [int(i) for i, _ in losses] == [1, 2, 3], text[-3000:]
    assert all(math.isfinite(float(x)) for _, x in losses)
