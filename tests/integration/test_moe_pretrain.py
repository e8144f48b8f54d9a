"""End to end: scripts/pretrain_gpt.py on CPU trains a MoE GPT (megatron's MoE layer, two experts, top-2
routing with the load-balancing loss, all-to-all dispatcher) under a schedule that splits the backward.

One short run at PP = 2; that the gradients are right is tests/verification/test_verify_moe.py's job.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from test_megatron_pretrain import ITERS, launch, results

MOE = ["--num-experts", "2", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01",
       "--moe-token-dispatcher-type", "alltoall"]  # fmt: skip
AUX = re.compile(r"iteration\s+\d+/.*load_balancing_loss: ([0-9.E+-]+)")


@pytest.mark.gloo
def test_moe_model_trains_under_zb_h1(tmp_path: Path) -> None:
    proc, log = launch(tmp_path, "moe", [*MOE, "--pipeline-schedule", "zb-h1"], {})
    try:
        code = proc.wait(timeout=240)
    except BaseException:
        proc.kill()
        raise
    text = log.read_text()
    assert code == 0, text[-4000:]
    assert "pipeline schedule 'zb-h1' replaces megatron's" in text
    logged, losses = results(tmp_path, "moe", log)
    assert [int(x[0]) for x in logged] == list(range(1, ITERS + 1))
    assert len(losses) == ITERS * 4  # 8 / 2 = 4 micro-batches per iteration
    assert all(math.isfinite(float.fromhex(x)) for x in losses)
    aux = [float(x) for x in AUX.findall(text)]
    assert len(aux) == ITERS and all(math.isfinite(a) and a > 0 for a in aux), aux
