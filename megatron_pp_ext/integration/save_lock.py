"""One run at a time saves into a ``--save`` directory.

Megatron writes a checkpoint as one file (or shard) per rank and a tracker file; nothing stops a
second run from saving into the same directory, and both then exit 0 leaving iteration folders that
mix the shards of both runs. So a run with ``--save`` holds a lock file, :data:`LOCK_NAME` in that
directory, for its whole lifetime:

* created by global rank 0 with ``O_CREAT | O_EXCL`` (atomic on local and NFS v3+ file systems) as
  soon as the process groups exist, holding the owner's pid, host and start time (JSON);
* kept fresh: a daemon thread of the owner touches it every :data:`HEARTBEAT_S` seconds;
* removed at exit by the owning process (``atexit``; a run killed hard leaves it behind);
* stale, and taken over with a note, when its owner is gone: on the same host as soon as the pid
  no longer exists; on any host once the lock has not been touched for :data:`STALE_S` seconds
  (a reused pid on the same host does not keep a dead run's lock either).

Rank 0's verdict reaches every rank of the run through one broadcast on the world group, so a
refused run stops on all ranks at once, with one line from rank 0, before any model is built.
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

LOCK_NAME = ".megatron_pp_ext.lock"
HEARTBEAT_S = 10.0
STALE_S = 60.0  # six missed heartbeats


@dataclass(frozen=True)
class Owner:
    """Who holds a lock, as its file says (``pid`` 0 / host ``?``: the file could not be read)."""

    pid: int
    host: str
    started: str
    age_s: float  # seconds since the owner last touched the file

    def alive(self) -> bool:
        """Could the owner still be running? (False only when it is certainly gone.)"""
        if self.age_s > STALE_S:
            return False
        if self.host != socket.gethostname() or self.pid <= 0:
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # exists, owned by another user
            return True
        return True

    def __str__(self) -> str:
        return f"pid {self.pid} on host {self.host}, started {self.started}, lock touched {self.age_s:.0f} s ago"


def read_owner(path: Path) -> Owner | None:
    """The owner recorded in ``path``; None when there is no such file."""
    try:
        text = path.read_text()
        age = time.time() - path.stat().st_mtime
    except FileNotFoundError:
        return None
    except OSError:
        return Owner(0, "?", "?", 0.0)
    try:
        data = json.loads(text)
        return Owner(int(data["pid"]), str(data["host"]), str(data["started"]), age)
    except (ValueError, KeyError, TypeError):  # being written, or not ours: judge by age alone
        return Owner(0, "?", "?", age)


class SaveDirLock:
    """The lock of one ``--save`` directory, held by this process once :meth:`acquire` returned None."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.path = Path(directory) / LOCK_NAME
        self._record = json.dumps(
            {
                "pid": os.getpid(),
                "host": socket.gethostname(),
                "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
        )
        self._stop = threading.Event()
        self.held = False
        self.taken_over: Owner | None = None  # the stale owner whose lock this one replaced

    def acquire(self) -> Owner | None:
        """Take the lock; return None when taken, else the live owner holding it."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                owner = read_owner(self.path)
                if owner is None:
                    continue  # released meanwhile
                if owner.alive():
                    return owner
                self._remove_stale(owner)
                continue
            with os.fdopen(fd, "w") as out:
                out.write(self._record)
            self.held = True
            threading.Thread(target=self._heartbeat, name="save-dir-lock", daemon=True).start()
            atexit.register(self.release)
            return None
        return read_owner(self.path) or Owner(0, "?", "?", 0.0)

    def _remove_stale(self, owner: Owner) -> None:
        """Remove a stale lock, unless it changed since it was judged (another run took it over)."""
        now = read_owner(self.path)
        if now is not None and (now.pid, now.host, now.started) == (owner.pid, owner.host, owner.started):
            try:
                self.path.unlink()
            except FileNotFoundError:
                pass
            self.taken_over = owner

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:  # removed by hand: nothing left to keep fresh
                return

    def release(self) -> None:
        """Remove the lock if this process holds it and the file is still ours."""
        self._stop.set()
        if not self.held:
            return
        self.held = False
        try:
            if self.path.read_text() == self._record:
                self.path.unlink()
        except OSError:
            pass


_HELD: list[SaveDirLock] = []


def refusal(directory: str, owner: Owner) -> str:
    """The one line a refused run prints."""
    return (
        f"--save {directory} is in use by another run ({owner}; lock file {Path(directory) / LOCK_NAME}): two runs "
        "saving into one directory leave checkpoints that mix both runs' shards. Use another --save directory, or "
        "wait for that run to end (the lock of a run that died is taken over: at once on its host, after "
        f"{STALE_S:.0f} s elsewhere)"
    )


def lock_on_all_ranks(directory: str) -> None:
    """Rank 0 takes the lock of ``directory``; every rank learns the verdict and a refused run stops (status 1)."""
    import torch.distributed as dist

    verdict: list[Any] = [None]
    held = any(lock.held and lock.path.parent == Path(directory) for lock in _HELD)
    if dist.get_rank() == 0 and not held:  # held: megatron set its groups up again in this run
        lock = SaveDirLock(directory)
        owner = lock.acquire()
        if owner is None:
            _HELD.append(lock)
            if lock.taken_over is not None:
                print(f"megatron_pp_ext: took over the stale lock of --save {directory} ({lock.taken_over})")
        else:
            verdict[0] = refusal(directory, owner)
    dist.broadcast_object_list(verdict, src=0)
    if verdict[0] is None:
        return
    if dist.get_rank() == 0:
        sys.stderr.write(f"megatron_pp_ext: error: {verdict[0]}\n")
        sys.stderr.flush()
    sys.stdout.flush()
    os._exit(1)  # every rank got the same verdict; nothing built yet, no gloo teardown at exit


def hold_save_dir_lock(args: Any) -> None:
    """With ``--save``: lock the directory right after megatron builds its process groups (idempotent)."""
    import importlib

    from ._patching import replace_everywhere

    directory = getattr(args, "save", None)
    if not directory:
        return
    module = importlib.import_module("megatron.core.parallel_state")
    original = module.initialize_model_parallel
    if getattr(original, "_megatron_pp_ext_save_lock", False):
        return

    def initialize_model_parallel(*a: Any, **kw: Any) -> Any:
        result = original(*a, **kw)
        lock_on_all_ranks(directory)
        return result

    initialize_model_parallel._megatron_pp_ext_save_lock = True  # type: ignore[attr-defined]
    replace_everywhere("megatron.core.parallel_state", "initialize_model_parallel", initialize_model_parallel)
