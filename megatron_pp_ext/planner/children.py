"""Child processes of the launchers (``launch-local``'s torchrun runs, ``grid --check``'s flag listing), each
in a process group of its own that dies with its launcher.

A child runs in a new session (its process group: torchrun and every worker it starts). While the launcher
waits for it, SIGTERM and SIGINT are forwarded to that whole group, the launcher waits for the group to
exit (SIGKILL after :data:`GRACE_S` seconds) and then stops itself with the usual status ``128 + signal``.
Before this, SIGTERM to ``launch-local`` ended only the launcher: torchrun and its workers ran on, orphaned.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["GRACE_S", "run_child", "stop_group"]

GRACE_S = 30.0  # seconds a child's group gets to exit after SIGTERM before SIGKILL
FORWARDED = (signal.SIGTERM, signal.SIGINT)


def stop_group(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM, grace_s: float = GRACE_S) -> None:
    """Send ``sig`` to the child's process group, wait for the child, SIGKILL the group after ``grace_s``."""
    for attempt in (sig, signal.SIGKILL):
        try:
            os.killpg(proc.pid, attempt)
        except (ProcessLookupError, PermissionError):
            pass  # the group is gone already
        try:
            proc.wait(timeout=grace_s)
            break
        except subprocess.TimeoutExpired:
            continue
    else:
        proc.wait()
    try:  # workers of the group that outlived their parent (torchrun) get no grace
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def run_child(
    cmd: Sequence[str], *, timeout: float | None = None, grace_s: float = GRACE_S, **popen: Any
) -> tuple[int, str | None, str | None]:
    """Run ``cmd`` in its own process group; ``(exit code, stdout, stderr)`` (the texts when piped).

    On ``timeout`` the group is stopped (SIGTERM, then SIGKILL) and ``subprocess.TimeoutExpired`` raised.
    A SIGTERM or SIGINT to the launcher meanwhile stops the group the same way, then the launcher exits
    with status ``128 + signal`` and one line saying so."""
    proc = subprocess.Popen(list(cmd), start_new_session=True, **popen)

    def forward(signum: int, _frame: object) -> None:
        raise _Stopped(signum)  # out of the wait: the group is stopped below, with a bounded grace

    main = threading.current_thread() is threading.main_thread()  # handlers can only be set there
    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED} if main else {}
    try:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_group(proc, signal.SIGTERM, grace_s)
            raise
        except _Stopped as stopped:
            for sig in previous:  # a second signal while the group stops must not interrupt the stopping
                signal.signal(sig, signal.SIG_IGN)
            stop_group(proc, stopped.signum, grace_s)
            name = signal.Signals(stopped.signum).name
            print(f"megatron-pp: stopped by {name}; its child ({cmd[0]} ...) and that child's group stopped too",
                  file=sys.stderr)  # fmt: skip
            raise SystemExit(128 + stopped.signum) from None
        return proc.returncode, out, err
    finally:
        if proc.poll() is None:  # an exception on the way out: never leave the group behind
            stop_group(proc, signal.SIGTERM, grace_s)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Stopped(BaseException):
    """A forwarded signal, raised out of the launcher's wait."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
