"""End to end: multi-token prediction (``--mtp-num-layers 1``, rotary positions) under scripts/pretrain_gpt.py:
megatron's own 1F1B and ours give bitwise the same losses and the same logged ``mtp_1 loss`` (the MTP stage gets
its tokens), and a V schedule (the MTP layers with the loss on rank 0) trains with both losses falling."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_megatron_pretrain import launch, results

MTP = ["--position-embedding-type", "rope", "--mtp-num-layers", "1", "--train-iters", "4"]
MTP_LINE = re.compile(r"lm loss: ([0-9.E+-]+) \| mtp_1 loss: ([0-9.E+-]+)")


def _finish(runs: dict[str, tuple]) -> dict[str, str]:
    logs = {}
    for name, (proc, log) in runs.items():
        try:
            code = proc.wait(timeout=300)
        except Exception:
            proc.kill()
            raise
        logs[name] = log.read_text()
        assert code == 0, f"{name} run failed:\n{logs[name][-4000:]}"
    return logs


@pytest.mark.gloo
def test_mtp_under_megatrons_1f1b_ours_and_v_zb(tmp_path: Path) -> None:
    runs = {
        "megatron": launch(tmp_path, "megatron", MTP, {}),
        "1f1b": launch(tmp_path, "1f1b", ["--pipeline-schedule", "1f1b", *MTP], {}),
        "v-zb": launch(tmp_path, "v-zb", ["--pipeline-schedule", "v-zb", "--num-layers", "4", *MTP], {}),
    }
    logs = _finish(runs)
    mtp = {name: [tuple(map(float, m)) for m in MTP_LINE.findall(text)] for name, text in logs.items()}
    assert len(mtp["megatron"]) == 4
    assert mtp["1f1b"] == mtp["megatron"]  # megatron's logged MTP loss, from the MTP stage's own tokens
    assert results(tmp_path, "1f1b", runs["1f1b"][1])[1] == results(tmp_path, "megatron", runs["megatron"][1])[1]
    first, last = mtp["v-zb"][0], mtp["v-zb"][-1]
    assert last[0] < first[0] and last[1] < first[1]  # lm and MTP losses fall with MTP on rank 0's last chunk
