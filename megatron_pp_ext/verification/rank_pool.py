"""A pool of rank processes that run jobs, reused across runs (imports cost ~10 s per spawned process).

``verify``, the benchmarks and the tests run their gloo ranks here: each job is a picklable function
called on every rank with ``(payload, rank, init_method)``; a rank's failure comes back as a result
with the error, a rank that dies or a job that exceeds its wall time is reported and the pool respawns.
A run's ``init_method`` (``rankpool://HOST:PORT``) names a store server the driver started for the run:
``torch.distributed.init_process_group`` takes it in the workers, each rank a client of that server.
:func:`check_errors` turns a failed rank's result into :class:`VerifyRunError`.
"""

from __future__ import annotations

import datetime
import os
import queue
import time
import traceback
from collections.abc import Iterator
from typing import Any

_PROGRESS: tuple[int, Any] | None = None  # (worker index, outbox) inside a pool worker


class VerifyRunError(RuntimeError):
    """A rank failed while running a job."""


def check_errors(results: list[Any], error: type[Exception] = VerifyRunError) -> None:
    """Raise ``error`` with the first failed rank's message and traceback (a rank killed after another
    failed is reported only when no rank failed by itself)."""
    errors = [r for r in results if isinstance(r, dict) and "error" in r]
    if errors:
        first = next((r for r in errors if "killed after" not in r["error"]), errors[0])
        raise error(first["error"] + "\n" + first.get("tb", ""))


def report_progress(text: str) -> None:
    """From a rank: a progress line for the driver (``RankPool(on_progress=...)``); no-op elsewhere."""
    if _PROGRESS is not None:
        _PROGRESS[1].put(("progress", _PROGRESS[0], text))


def _driver_gone(driver_pid: int, parent: int) -> bool:
    """Whether the driver died (killed): this worker's parent (the driver, or the fork server, which exits with
    it) changed, or the driver's pid is gone (it may have died before this worker started)."""
    if os.getppid() != parent:
        return True
    try:
        os.kill(driver_pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # a pid of another user's process: ours is gone
        return True
    return False


def _worker(index: int, inbox: Any, outbox: Any, driver_pid: int) -> None:
    global _PROGRESS
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _PROGRESS = (index, outbox)
    parent = os.getppid()
    _register_rendezvous()
    while True:
        try:
            job = inbox.get(timeout=5.0)
        except queue.Empty:
            if _driver_gone(driver_pid, parent):  # do not linger as an orphan
                return
            continue
        if job is None:  # the pool closes: flush the results, then skip torch's interpreter teardown
            outbox.close()
            outbox.join_thread()
            os._exit(0)
        fn, payload, rank, init_method = job
        try:
            outbox.put((index, fn(payload, rank, init_method)))
        except BaseException as exc:  # report every failure to the driver, with the rank
            outbox.put((index, {"error": f"rank {rank}: {type(exc).__name__}: {exc}", "tb": traceback.format_exc()}))


#: The rendezvous of a pool's runs (:func:`_rendezvous`).
SCHEME = "rankpool"


def _rendezvous(url: str, timeout: datetime.timedelta = datetime.timedelta(minutes=30), **kwargs: Any) -> Iterator[Any]:
    """``init_process_group``'s rendezvous for ``rankpool://HOST:PORT?rank=R&world_size=N``: every rank is a
    client of the store server the driver started for the run. That server listens before any rank starts;
    with ``tcp://`` rank 0 starts it, and a rank that connects before then waits out the client's retry
    back-off (about half a second, every rank, in about a third of the runs)."""
    from urllib.parse import parse_qs, urlparse

    import torch.distributed as dist

    parsed = urlparse(url)
    query = {key: values[-1] for key, values in parse_qs(parsed.query).items()}
    assert parsed.hostname is not None and parsed.port is not None, url
    store = dist.TCPStore(parsed.hostname, parsed.port, is_master=False, timeout=timeout)
    yield store, int(query["rank"]), int(query["world_size"])
    raise RuntimeError("a rank pool's run has one rendezvous")


def _register_rendezvous() -> None:
    from torch.distributed.rendezvous import register_rendezvous_handler

    try:
        register_rendezvous_handler(SCHEME, _rendezvous)
    except RuntimeError:  # registered already (a forked worker inherits it)
        pass


def _run_store() -> Any:
    """A store server for one run, listening on a free local port."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


class RankPool:
    """``size`` spawned rank processes that run jobs; reuse it across runs.

    ``warm_module``: the processes are forked from one fork server that imported this module once (the test
    suite's ``tests/warm_rank.py`` does a CPU rank's set-up and its imports there), instead of each spawned and
    importing torch and megatron itself (seconds of CPU each). A forked worker starts as a spawned one is after
    its first CPU run; it keeps the fork server's environment (that of the first warm pool of this process) and
    runs CPU jobs only. The default spawns.

    When a rank fails, the others get ``grace_s`` seconds to finish (a peer of a
    failed rank is usually stuck in a collective with it); ranks still running
    then are killed and reported as such, and the pool respawns its processes on
    the next run.
    """

    def __init__(
        self, size: int, grace_s: float = 15.0, on_progress: Any = None, warm_module: str | None = None
    ) -> None:
        self.size = size
        self.warm_module = warm_module
        self.grace_s = grace_s
        self.on_progress = on_progress  # callable(text) for the ranks' progress lines, or None
        self.procs: list[Any] = []
        self._spawn()

    def _spawn(self) -> None:
        import torch.multiprocessing as mp

        if self.warm_module is not None:
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload([self.warm_module])  # no effect once this process's fork server runs
        else:
            ctx = mp.get_context("spawn")
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(self.size)]
        driver = os.getpid()
        self.procs = [
            ctx.Process(target=_worker, args=(i, self.inboxes[i], self.outbox, driver), daemon=True)
            for i in range(self.size)
        ]
        for p in self.procs:
            p.start()

    def run_fn(self, fn: Any, payload: Any, world_size: int, wall_timeout_s: float = 300.0) -> list[Any]:
        """Call ``fn(payload, rank, init_method)`` on ranks ``0..world_size-1``; ``fn`` must be importable."""
        if world_size > self.size:
            raise ValueError(f"run needs {world_size} ranks, the pool has {self.size}")
        if not self.procs or not all(p.is_alive() for p in self.procs):
            self.close(kill=True)
            self._spawn()
        store = _run_store()  # kept until the run is over: the ranks' groups use it
        init_method = f"{SCHEME}://127.0.0.1:{store.port}"
        for rank in range(world_size):
            self.inboxes[rank].put((fn, payload, rank, init_method))
        results: dict[int, Any] = {}
        deadline = time.monotonic() + wall_timeout_s
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(results))
                self.close(kill=True)
                if any(isinstance(r, dict) and "error" in r for r in results.values()):
                    for rank in missing:
                        results[rank] = {"error": f"rank {rank}: killed after another rank failed", "tb": ""}
                    break
                raise TimeoutError(f"ranks {missing} did not finish within {wall_timeout_s:g}s; the pool was killed")
            try:
                message = self.outbox.get(timeout=min(remaining, 2.0))
                if len(message) == 3:  # ("progress", worker, text)
                    if self.on_progress is not None:
                        self.on_progress(message[2])
                    continue
                index, result = message
            except queue.Empty:
                dead = [i for i in range(world_size) if not self.procs[i].is_alive()]
                if dead:
                    self.close(kill=True)
                    raise RuntimeError(f"rank process(es) {dead} died") from None
                continue
            results[index] = result
            if isinstance(result, dict) and "error" in result:
                deadline = min(deadline, time.monotonic() + self.grace_s)
        return [results[r] for r in range(world_size)]

    def close(self, kill: bool = False) -> None:
        for i, p in enumerate(self.procs):
            if p.is_alive():
                if kill:
                    p.kill()
                else:
                    self.inboxes[i].put(None)
        for p in self.procs:
            p.join(timeout=10)
        self.procs = []

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(kill=exc[0] is not None)
