"""End to end: a mistyped flag or schedule under torchrun gives one line per problem (rank 0 only),
not megatron's usage text per rank, and every rank exits non-zero."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_pretrain_mismatch import run_per_rank


@pytest.mark.gloo
def test_mistyped_flags_give_one_line_each_from_rank_0(tmp_path: Path) -> None:
    bad = ["--pipline-memory-limit", "2p", "--pipeline-schedule", "zb-h3", "--num-layrs", "4"]
    code, log, _ = run_per_rank(tmp_path, [bad, bad], torchrun=True)  # the ranks' exit status: torchrun's report
    assert code != 0, log[-3000:]
    errors = [line for line in log.splitlines() if "pretrain_gpt.py: error:" in line]
    assert len(errors) == 3, log[-3000:]  # three problems, printed once (rank 0), not per rank
    assert any("unknown flag --pipline-memory-limit (did you mean --pipeline-memory-limit?)" in e for e in errors)
    assert any("unknown flag --num-layrs (did you mean --num-layers?)" in e for e in errors)
    assert any("argument --pipeline-schedule: unknown pipeline schedule 'zb-h3'" in e for e in errors)
    assert "usage:" not in log and "exitcode  : 2" in log  # megatron's usage text nowhere; exit status 2
    assert log.count("Traceback") <= 1  # at most torchrun's own ChildFailedError, none from the ranks
    assert "Apex is not installed" not in log and log.count("CPU mode: Apex and Transformer Engine") <= 1
