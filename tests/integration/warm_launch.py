"""Start ``scripts/pretrain_gpt.py`` on ``nproc`` CPU ranks, as torchrun does, without paying its imports per run.

A tiny pre-training run spends most of its time importing torch, megatron and the plugin (about 6 s of CPU per
rank against under 2 s of training), and the integration tests start dozens of them. :func:`launch` hands the
run to one server process per test session (``warm_ranks_server.py``) that has imported them once and forks
the ranks, each with torchrun's environment variables, its own log and the script run as ``__main__``: the same
script, flags, process groups and gloo traffic as under torchrun; only the process start differs.

Falls back to real torchrun (``python -m torch.distributed.run``) when the run's environment changes a
variable that torch or megatron read at import time (anything but the plugin's ``MEGATRON_PP_*`` variables and
``PYTHONPATH``), when ``WARM_LAUNCH=0``, or for tests that exercise torchrun itself (``torchrun=True``).
:func:`launch` returns a :class:`Run` with the part of ``subprocess.Popen``'s interface the tests use.
"""

from __future__ import annotations

import atexit
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.integration.rendezvous_port import rendezvous_port
from tests.tiers import launches_ranks

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "pretrain_gpt.py"
SERVER = Path(__file__).with_name("warm_ranks_server.py")
# read by the script or the plugin at run time only; pytest names the running test in PYTEST_CURRENT_TEST
FREE_TO_CHANGE = ("MEGATRON_PP_", "PYTHONPATH", "PYTEST_CURRENT_TEST")
SERVER_ENV = {"OMP_NUM_THREADS": "1"}


def free_port() -> int:
    """A port for torchrun's rendezvous (:func:`tests.integration.rendezvous_port.rendezvous_port`)."""
    return rendezvous_port()


def run_env(**extra: str) -> dict[str, str]:
    """The environment of a test run: the test process's, one thread per rank, this checkout first on the path."""
    env = {**os.environ, **SERVER_ENV, **extra}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    return env


class Run:
    """A run started by the server: ``wait``, ``poll``, ``kill``, ``returncode``, ``pid`` like ``Popen``."""

    def __init__(self, pid: int, rc_file: Path) -> None:
        self.pid = pid
        self._rc_file = rc_file
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self._rc_file.exists():
            self.returncode = int(self._rc_file.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"warm run {self.pid}", timeout or 0.0)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


class _Server:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._env: dict[str, str] = {}
        self._requests = None
        self._replies = None
        self._ids = itertools.count()

    def start(self) -> None:
        request_r, request_w = os.pipe()
        reply_r, reply_w = os.pipe()
        self._env = run_env()
        self._proc = subprocess.Popen(
            [sys.executable, str(SERVER), str(ROOT), str(request_r), str(reply_w)],
            env=self._env, pass_fds=(request_r, reply_w), stdin=subprocess.DEVNULL,
        )  # fmt: skip
        os.close(request_r)
        os.close(reply_w)
        self._requests = os.fdopen(request_w, "w")
        self._replies = os.fdopen(reply_r, "r")
        if self._replies.readline().strip() != "ready":
            raise RuntimeError("the warm launch server did not start (see the output above)")
        atexit.register(self.stop)

    def stop(self) -> None:
        if self._requests is not None:
            self._requests.close()
            self._requests = None
        if self._proc is not None:
            self._proc.wait(timeout=30)
            self._proc = None

    def compatible(self, env: dict[str, str]) -> bool:
        changed = {k for k in set(env) | set(self._env) if env.get(k) != self._env.get(k)}
        return all(k.startswith(FREE_TO_CHANGE) for k in changed)

    def launch(self, cwd: Path, nproc: int, argv: list[str], env: dict[str, str], log: Path) -> Run | None:
        with self._lock:
            if self._proc is None:
                self.start()
            if not self.compatible(env):
                return None
            rc_file = log.with_name(f"{log.name}.rc{next(self._ids)}")
            request = {"cwd": str(cwd), "env": env, "argv": argv, "nproc": nproc, "log": str(log),
                       "rc_file": str(rc_file)}  # fmt: skip
            assert self._requests is not None and self._replies is not None
            self._requests.write(json.dumps(request) + "\n")
            self._requests.flush()
            return Run(int(self._replies.readline()), rc_file)


_SERVER = _Server()


@launches_ranks
def launch(
    tmp: Path, name: str, flags: list[str], *, nproc: int = 2, env: dict[str, str] | None = None,
    torchrun: bool = False, script: Path = SCRIPT,
) -> tuple[Run | subprocess.Popen, Path]:  # fmt: skip
    """Start ``pretrain_gpt.py FLAGS`` (or another driver, ``script``) on ``nproc`` ranks in ``tmp``; output in
    ``tmp/NAME.log``. ``env``: the whole environment (default :func:`run_env`)."""
    env = run_env() if env is None else env
    log = tmp / f"{name}.log"
    log.write_text("")
    if not torchrun and os.environ.get("WARM_LAUNCH", "1") != "0":
        run = _SERVER.launch(tmp, nproc, [str(script), *flags], env, log)
        if run is not None:
            return run, log
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
           str(free_port()), str(script), *flags]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    return proc, log
