"""The server behind :mod:`warm_launch`: imports torch, megatron and the plugin once, then forks each run's ranks.

Started by :class:`warm_launch.WarmLauncher` as ``python warm_ranks_server.py ROOT REQUEST_FD REPLY_FD``. It does
what ``scripts/pretrain_gpt.py`` does before its first megatron import in CPU mode (the CPU shims), imports the
modules that cost the seconds, and then serves requests, one JSON line each on REQUEST_FD: ``{"cwd", "env",
"argv", "nproc", "log", "rc_file"}``. For each it forks a *job* (its own process group), which forks ``nproc``
ranks: each rank takes the request's environment plus torchrun's (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, ...), writes stdout and stderr to the log, and runs the script as ``__main__`` with the request's
argv, exactly as under torchrun but without importing anything again. Like torchrun's agent, the job stops the
other ranks when one fails (after a grace period, so that a peer's own one-line error still reaches the log) and
exits 0 only if every rank did; it writes that code to ``rc_file``. The server replies with the job's pid and
reaps finished jobs; it stops its jobs and exits when REQUEST_FD closes.

No threads are started here before a fork (a forked child keeps only the forking thread, and a lock held by
another thread would stay held forever).
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import signal
import sys
import time
import traceback

GRACE_S = 10.0  # how long the other ranks may still run after one failed (torchrun's agent: similar)


def _preload(root: str) -> None:
    sys.path.insert(0, root)
    from megatron_pp_ext.integration import cpu

    cpu.hide_missing_accelerator_warnings(announce=False)
    cpu.enable_cpu_training_mode(force=True)
    import megatron.core.datasets.gpt_dataset
    import megatron.training
    import megatron.training.arguments  # noqa: F401

    import megatron_pp_ext
    import megatron_pp_ext.integration.install
    import megatron_pp_ext.runtime.executor  # noqa: F401


def _rank(request: dict, rank: int, port: int) -> None:
    """The body of one rank's process (never returns)."""
    code = 1
    try:
        os.chdir(request["cwd"])
        env = dict(request["env"])
        nproc = request["nproc"]
        env.update(
            RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
            GROUP_RANK="0", ROLE_RANK=str(rank), ROLE_WORLD_SIZE=str(nproc), MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port), TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
        )  # fmt: skip
        os.environ.clear()
        os.environ.update(env)
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        sys.argv = list(request["argv"])
        runpy.run_path(sys.argv[0], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _job(request: dict) -> None:
    """One run: fork the ranks, wait for them like torchrun's agent, write the exit code (never returns)."""
    os.setsid()
    code = 1
    try:
        from rendezvous_port import rendezvous_port  # this script's neighbour

        port = rendezvous_port()
        ranks = []
        for rank in range(request["nproc"]):
            pid = os.fork()
            if pid == 0:
                _rank(request, rank, port)
            ranks.append(pid)
        codes: dict[int, int] = {}
        deadline = None
        while len(codes) < len(ranks):
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                if deadline is not None and time.monotonic() > deadline:
                    for other in ranks:
                        if other not in codes:
                            os.kill(other, signal.SIGKILL)
                    deadline = None
                time.sleep(0.05)
                continue
            codes[pid] = os.waitstatus_to_exitcode(status)
            if codes[pid] != 0 and deadline is None and len(codes) < len(ranks):
                deadline = time.monotonic() + GRACE_S
        code = 0 if all(c == 0 for c in codes.values()) else 1
    finally:
        with open(request["rc_file"] + ".tmp", "w") as f:
            f.write(str(code))
        os.replace(request["rc_file"] + ".tmp", request["rc_file"])
        os._exit(code)


def serve(root: str, request_fd: int, reply_fd: int) -> None:
    _preload(root)
    requests = os.fdopen(request_fd, "r")
    replies = os.fdopen(reply_fd, "w")
    jobs: set[int] = set()
    replies.write("ready\n")
    replies.flush()
    while True:
        readable, _, _ = select.select([requests], [], [], 0.2)
        while jobs:
            pid, _ = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            jobs.discard(pid)
        if not readable:
            continue
        line = requests.readline()
        if not line:
            break
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            requests.close()
            replies.close()
            _job(request)
        jobs.add(pid)
        replies.write(f"{pid}\n")
        replies.flush()
    for pid in jobs:
        try:
            os.killpg(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
