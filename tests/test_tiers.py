"""The test tiers (tests/tiers.py): real-rank tests are found by what they use, and an unmarked one fails at its
launch with "mark this test gloo" (this module's tests are unmarked, so they run under the guard)."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.tier_guard.rank_guard import UnmarkedRankLaunchError, is_rank_launch
from tests.tiers import calls_rank_launcher, fixture_launches_ranks, launches_ranks

ROOT = Path(__file__).resolve().parents[1]

SYNTHETIC = """
import pytest
from tests.tiers import launches_ranks

@pytest.fixture
@launches_ranks
def ranks():
    yield 4

@pytest.fixture
def through_ranks(ranks):
    return ranks

@launches_ranks
def launch():
    pass

def helper():
    launch()

def test_uses_rank_fixture(ranks): pass
def test_uses_rank_fixture_through_another(through_ranks): pass
def test_calls_tagged_helper(): helper()
def test_calls_tagged_helper_in_a_lambda(): (lambda: launch())()
@pytest.mark.gloo
def test_marked_by_hand(): pass
def test_pure(): pass
"""


@launches_ranks
def _launch() -> None:
    pass


def _through_a_helper() -> None:
    _launch()


def _pure() -> int:
    return len(str(ROOT))


def test_a_call_of_a_tagged_helper_is_seen_through_the_modules_functions() -> None:
    assert calls_rank_launcher(_launch) is False  # the launcher itself names nothing tagged
    assert calls_rank_launcher(_through_a_helper)
    assert calls_rank_launcher(lambda: _through_a_helper())
    assert not calls_rank_launcher(_pure)


def test_a_tagged_fixture_makes_a_rank_test() -> None:
    assert fixture_launches_ranks(iter([_pure, _launch]))
    assert not fixture_launches_ranks(iter([_pure]))


@pytest.mark.slow
def test_collection_marks_rank_tests_and_quick_leaves_them_out(tmp_path: Path) -> None:
    (tmp_path / "test_synthetic.py").write_text(textwrap.dedent(SYNTHETIC))
    command = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "tests.conftest", "-m", "not gloo"]
    proc = subprocess.run([*command, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    selected = [line.split("::")[-1] for line in proc.stdout.splitlines() if "::" in line]
    assert selected == ["test_pure"], proc.stdout + proc.stderr


def test_a_torchrun_launch_is_told_from_a_path_that_names_it() -> None:
    assert is_rank_launch([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "train.py"])
    assert is_rank_launch("torchrun --nproc-per-node 2 train.py")
    assert is_rank_launch(["/opt/venv/bin/torchrun", "train.py"])
    assert not is_rank_launch(["bash", "/tmp/pytest-0/test_readme_torchrun_comma0/job.sbatch"])
    assert not is_rank_launch([sys.executable, "-c", "print('torchrun')"])


def test_guard_refuses_a_process_group_here() -> None:
    with pytest.raises(UnmarkedRankLaunchError, match="mark this test gloo"):
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:1", rank=0, world_size=1)


def test_guard_refuses_worker_processes_and_torchrun_here() -> None:
    with pytest.raises(UnmarkedRankLaunchError, match=r"test_tiers\.py::.* starts a worker process"):
        multiprocessing.get_context("spawn").Process(target=print).start()
    with pytest.raises(UnmarkedRankLaunchError, match="launches torchrun"):
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "x.py"], check=False)


def test_guard_holds_in_a_child_interpreter() -> None:
    """A CLI command run as a subprocess that spawns ranks: the child's own spawn is refused."""
    script = "import multiprocessing as mp; mp.get_context('spawn').Process(target=print).start()"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode != 0 and "mark this test gloo" in proc.stderr, proc.stderr
    clean_env = {"PATH": "/usr/bin:/bin"}  # an explicit environment gets the guard too
    proc = subprocess.run(
        [sys.executable, "-c", script], env=clean_env, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode != 0 and "mark this test gloo" in proc.stderr, proc.stderr


@pytest.mark.slow  # the child imports torch
def test_guard_refuses_a_process_group_in_a_child_interpreter() -> None:
    group = "import torch.distributed as d; d.init_process_group('gloo', store=d.HashStore(), rank=0, world_size=1)"
    proc = subprocess.run([sys.executable, "-c", group], capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode != 0 and "starts a process group" in proc.stderr, proc.stderr
