"""End to end: a V schedule on megatron's uneven-split flag under scripts/pretrain_gpt.py (megatron's training loop).

``--decoder-first-pipeline-num-layers 1`` means the first *model stage* holds one layer: 1F1B at PP = 2 builds
[1, 3] on its two stages, v-half [1, 1, 1, 1] on its four (two per rank). Initial weights depend on which rank
builds a layer, so both runs load the same checkpoint (saved by 1F1B on the same flag after 2 iterations; a
``torch_dist`` checkpoint is keyed by global layer number) and then train the third iteration: every
micro-batch's loss must be bitwise 1F1B's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_megatron_pretrain import launch, results

UNEVEN = ["--decoder-first-pipeline-num-layers", "1", "--ckpt-format", "torch_dist"]
EXACT = ["--hidden-dropout", "0", "--attention-dropout", "0"]


def _finish(runs: dict[str, tuple]) -> None:
    for name, (proc, log) in runs.items():
        try:
            code = proc.wait(timeout=300)
        except Exception:
            proc.kill()
            raise
        assert code == 0, f"{name} run failed:\n{log.read_text()[-4000:]}"


@pytest.mark.gloo
def test_v_half_on_an_uneven_first_stage_trains_like_1f1b(tmp_path: Path) -> None:
    checkpoint = str(tmp_path / "checkpoint")
    save = ["--pipeline-schedule", "1f1b", *UNEVEN, *EXACT, "--save", checkpoint, "--save-interval", "2"]
    _finish({"save": launch(tmp_path, "save", [*save, "--exit-interval", "2"], {})})
    runs = {
        name: launch(tmp_path, name, ["--pipeline-schedule", name, *UNEVEN, *EXACT, "--load", checkpoint], {})
        for name in ("1f1b", "v-half")
    }
    _finish(runs)
    assert "pipeline schedule 'v-half' replaces megatron's" in runs["v-half"][1].read_text()
    logged_1f1b, losses_1f1b = results(tmp_path, "1f1b", runs["1f1b"][1])
    logged_v, losses_v = results(tmp_path, "v-half", runs["v-half"][1])
    assert len(losses_1f1b) == 4  # the third iteration's 4 micro-batches
    assert losses_v == losses_1f1b
    assert [x[1] for x in logged_v] == [x[1] for x in logged_1f1b]  # megatron's logged loss too
