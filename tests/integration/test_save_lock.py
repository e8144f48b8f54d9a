"""The ``--save`` directory lock (``megatron_pp_ext.integration.save_lock``), in processes of its own.

A live owner keeps the lock (another process is refused and told who holds it); a dead owner's
lock is taken over (same host: the pid is gone; any host: not touched for ``STALE_S``); the owner
removes only its own lock. The end-to-end refusal of a training run is in ``test_checkpoint_reload.py``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_pp_ext.integration import save_lock
from megatron_pp_ext.integration.save_lock import LOCK_NAME, STALE_S, SaveDirLock, read_owner

ROOT = Path(__file__).resolve().parents[2]
HOLD = """
import sys
from megatron_pp_ext.integration.save_lock import SaveDirLock
lock = SaveDirLock(sys.argv[1])
print("refused" if lock.acquire() else "held", flush=True)
sys.stdin.read()  # hold until the test closes stdin
"""


def _write_lock(directory: Path, pid: int, host: str, age_s: float = 0.0) -> Path:
    path = directory / LOCK_NAME
    path.write_text(json.dumps({"pid": pid, "host": host, "started": "2026-01-01T00:00:00Z"}))
    if age_s:
        old = time.time() - age_s
        os.utime(path, (old, old))
    return path


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_second_process_is_refused_while_the_first_holds_the_lock(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        owner = SaveDirLock(tmp_path).acquire()
        assert owner is not None and owner.pid == holder.pid and owner.host == socket.gethostname()
        line = save_lock.refusal(str(tmp_path), owner)
        assert f"--save {tmp_path} is in use by another run (pid {holder.pid} on host" in line and "\n" not in line
    finally:
        holder.communicate("", timeout=30)
    assert not (tmp_path / LOCK_NAME).exists()  # released at the holder's exit
    second = SaveDirLock(tmp_path)
    assert second.acquire() is None and second.taken_over is None
    second.release()


def test_lock_of_a_dead_process_on_this_host_is_taken_over(tmp_path: Path) -> None:
    pid = _dead_pid()
    _write_lock(tmp_path, pid, socket.gethostname())
    lock = SaveDirLock(tmp_path)
    assert lock.acquire() is None
    assert lock.taken_over is not None and lock.taken_over.pid == pid
    owner = read_owner(tmp_path / LOCK_NAME)
    assert owner is not None and owner.pid == os.getpid()
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


@pytest.mark.parametrize(
    "host, age_s, taken",
    [
        ("another-host", 0.0, False),  # can't see its pid: live while it keeps the lock fresh
        ("another-host", STALE_S + 5, True),
        (None, STALE_S + 5, True),  # this host, live pid (a reused one), but nobody touches the lock
    ],
)
def test_lock_freshness_decides_beyond_this_host(tmp_path: Path, host: str | None, age_s: float, taken: bool) -> None:
    _write_lock(tmp_path, os.getppid(), host or socket.gethostname(), age_s)
    lock = SaveDirLock(tmp_path)
    owner = lock.acquire()
    assert (owner is None) == taken, owner
    lock.release()


@pytest.mark.parametrize("age_s, taken", [(0.0, False), (STALE_S + 5, True)])
def test_unreadable_lock_is_judged_by_its_age(tmp_path: Path, age_s: float, taken: bool) -> None:
    path = tmp_path / LOCK_NAME
    path.write_text("")  # a run between creating the file and writing its owner
    if age_s:
        os.utime(path, (time.time() - age_s,) * 2)
    lock = SaveDirLock(tmp_path)
    assert (lock.acquire() is None) == taken
    lock.release()


def test_owner_keeps_the_lock_fresh_and_removes_only_its_own(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(save_lock, "HEARTBEAT_S", 0.05)
    lock = SaveDirLock(tmp_path)
    assert lock.acquire() is None
    path = tmp_path / LOCK_NAME
    os.utime(path, (time.time() - 30,) * 2)
    deadline = time.time() + 10
    while time.time() - path.stat().st_mtime > 5 and time.time() < deadline:
        time.sleep(0.05)
    assert time.time() - path.stat().st_mtime <= 5  # touched again by the heartbeat
    _write_lock(tmp_path, 12345, "another-host")  # replaced by hand: not ours any more
    lock.release()
    assert path.exists()


TWICE = """
import os, sys
import torch.distributed as dist
from megatron_pp_ext.integration.save_lock import lock_on_all_ranks
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
lock_on_all_ranks(sys.argv[1])
lock_on_all_ranks(sys.argv[1])  # megatron setting its groups up again: the run's own lock, not another run's
print("locked twice", os.getpid(), flush=True)
dist.destroy_process_group()
"""


@pytest.mark.gloo  # one gloo rank, in a child process
def test_a_run_setting_its_groups_up_again_keeps_its_own_lock(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-c", TWICE, str(tmp_path)], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0 and "locked twice" in proc.stdout, proc.stdout + proc.stderr
    assert not (tmp_path / LOCK_NAME).exists()  # released at exit
