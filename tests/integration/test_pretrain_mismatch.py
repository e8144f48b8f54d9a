"""End to end: ranks of one scripts/pretrain_gpt.py job given different schedules stop at once, in one line.

Rank 0 runs ``1f1b`` (one chunk per rank), rank 1 ``v-half`` (two): before the plugin's check,
megatron's process-group set-up blocked until ``--distributed-timeout-minutes`` (10 min).
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import NamedTuple

import pytest
from test_megatron_pretrain import FLAGS, SCRIPT
from warm_launch import launch, run_env


class PerRankRun(NamedTuple):
    code: int
    log: str
    torchrun: bool  # run by real torchrun (asked for, or the warm launcher could not take it), not warm


WRAPPER = """
import os, runpy, sys
per_rank = {per_rank!r}
sys.argv = [{script!r}, *sys.argv[1:], *per_rank[int(os.environ["RANK"])]]
runpy.run_path({script!r}, run_name="__main__")
"""


def run_per_rank(
    tmp: Path, per_rank: list[list[str]], env_extra: dict[str, str] | None = None, *, torchrun: bool = False
) -> PerRankRun:
    """Two ranks of one job, each with ``FLAGS`` and its own extra flags, through the warm launcher
    (tests/integration/warm_launch.py: torchrun's environment and process groups, no imports per run), or through
    real torchrun (``torchrun``: for a test that reads the ranks' exit status from torchrun's report)."""
    wrapper = tmp / "per_rank.py"
    wrapper.write_text(WRAPPER.format(per_rank=per_rank, script=str(SCRIPT)))
    env = run_env(**(env_extra or {}))
    run, log = launch(tmp, "per_rank", FLAGS, env=env, script=wrapper, torchrun=torchrun)
    code = run.wait(timeout=300)
    return PerRankRun(code, log.read_text(), isinstance(run, subprocess.Popen))


def rank_tracebacks(run: PerRankRun) -> list[str]:
    """The lines of the run's log that start a rank's traceback: under torchrun a rank's lines start with
    ``[rankN]`` (its agent's own ChildFailedError does not count); the warm launcher's log holds the ranks'
    output only."""
    lines = run.log.splitlines()
    return [line for line in lines if "Traceback" in line and (line.startswith("[rank") or not run.torchrun)]


@pytest.mark.gloo
def test_different_schedules_per_rank_stop_before_megatrons_group_setup(tmp_path: Path) -> None:
    start = time.monotonic()
    run = run_per_rank(tmp_path, [["--pipeline-schedule", "1f1b"], ["--pipeline-schedule", "v-half"]])
    code, log = run.code, run.log
    elapsed = time.monotonic() - start
    assert code != 0, log[-4000:]
    lines = [line for line in log.splitlines() if "the ranks disagree" in line]
    assert len(lines) == 2, log[-4000:]  # one line per rank
    assert all("pipeline configuration" in line and "rank 0: schedule=1f1b" in line for line in lines), lines
    assert all("rank 1: schedule=v-half" in line for line in lines), lines
    assert rank_tracebacks(run) == [], log[-4000:]
    assert all(
        "the ranks disagree on the pipeline configuration (--pipeline-* flags): schedule, v differ" in x for x in lines
    ), lines
    assert elapsed < 200  # imports (~30 s per rank on a busy machine) and no wait: not megatron's 10-minute timeout


@pytest.mark.gloo
def test_bad_timeout_variable_fails_before_any_process_group(tmp_path: Path) -> None:
    run = run_per_rank(tmp_path, [["--pipeline-schedule", "1f1b"]] * 2, {"MEGATRON_PP_P2P_TIMEOUT": "abc"})
    code, log = run.code, run.log
    assert code != 0
    lines = [line for line in log.splitlines() if "error:" in line and "MEGATRON_PP_P2P_TIMEOUT" in line]
    assert lines and all("MEGATRON_PP_P2P_TIMEOUT='abc': expected a number of seconds > 0" in x for x in lines), log
    assert rank_tracebacks(run) == [], log[-4000:]


@pytest.mark.gloo
def test_rank_without_pipeline_schedule_is_named_at_once(tmp_path: Path) -> None:
    """A rank started without --pipeline-schedule still joins the configuration agreement (as schedule=-):
    its peer stops with the disagreement instead of waiting the agreement's 300 s timeout for it."""
    start = time.monotonic()
    run = run_per_rank(tmp_path, [[], ["--pipeline-schedule", "1f1b"]], {"MEGATRON_PP_AGREE_TIMEOUT": "250"})
    code, log = run.code, run.log
    elapsed = time.monotonic() - start
    assert code != 0, log[-4000:]
    lines = [line for line in log.splitlines() if "the ranks disagree" in line]
    assert lines and all("rank 0: schedule=-" in x and "rank 1: schedule=1f1b" in x for x in lines), log[-4000:]
    assert "not every rank of the group reached the check" not in log, log[-4000:]
    assert elapsed < 200  # imports only, not the 250 s agreement timeout


@pytest.mark.gloo
def test_unit_size_disagreement_names_each_ranks_own_value(tmp_path: Path) -> None:
    zeropp = ["--pipeline-schedule", "zeropp", "--pipeline-unit-size"]
    run = run_per_rank(tmp_path, [[*zeropp, "2"], [*zeropp, "4"]])
    code, log = run.code, run.log
    assert code != 0, log[-4000:]
    lines = [line for line in log.splitlines() if "the ranks disagree" in line]
    assert lines and all("rank 0: unit_size=2" in x and "rank 1: unit_size=4" in x for x in lines), log[-4000:]
