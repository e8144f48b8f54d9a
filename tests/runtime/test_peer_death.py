"""Bounded waits: a peer that dies is named at once; a peer that never answers the re-plan's ping-pong
fails it after the timeout instead of hanging (it had no timeout)."""

from __future__ import annotations

import datetime
import os
import socket
import time
from typing import Any

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, init_method: str, out: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    from megatron_pp_ext.runtime import p2p

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip
    dist.barrier()
    if rank == 1:
        time.sleep(0.5)
        os._exit(17)  # killed mid-iteration, before the send rank 0 waits for
    buffer = torch.empty(4)
    recv = p2p.Transfer(buffer, 1, 0, "act[0->1 mb3 r1->r0]")
    start = time.monotonic()
    try:
        p2p.post([], [recv], None, rank_desc="pipeline rank 0, exchange before F1.3", timeout_s=300).wait()
        out.put(("no error", time.monotonic() - start))
    except p2p.PipelineCommError as exc:
        out.put((str(exc), time.monotonic() - start))
    out.close()
    out.join_thread()  # flush the result before leaving without gloo's teardown
    os._exit(0)


def test_survivor_names_the_dead_peer_and_the_op() -> None:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_rank_main, args=(r, init_method, out), daemon=True) for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        message, elapsed = out.get(timeout=120)
    except Exception:
        raise AssertionError(f"rank 0 did not report; exit codes {[p.exitcode for p in procs]}") from None
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    assert "pipeline rank 0, exchange before F1.3" in message
    assert "recv act[0->1 mb3 r1->r0] from rank 1" in message
    assert "a peer closed the connection (it died or exited)" in message
    assert "did not complete within" not in message
    assert elapsed < 60  # seconds, not the 300 s timeout


def _hop_main(rank: int, init_method: str, out: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    from megatron_pp_ext.runtime import p2p
    from megatron_pp_ext.runtime.replan import measure_hop_time

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip
    if rank == 1:
        time.sleep(15)  # busy elsewhere (another schedule): never joins the ping-pong
        os._exit(0)
    start = time.monotonic()
    try:
        measure_hop_time(dist.group.WORLD, (4,), torch.float32, "cpu", timeout_s=2.0)
        out.put(("no error", time.monotonic() - start))
    except p2p.PipelineCommError as exc:
        out.put((str(exc), time.monotonic() - start))
    out.close()
    out.join_thread()
    os._exit(0)


def _run_two(target: Any) -> tuple[str, float]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=target, args=(r, init_method, out), daemon=True) for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        return out.get(timeout=120)
    finally:
        for proc in procs:
            proc.join(timeout=20)
            if proc.is_alive():
                proc.kill()


def test_replan_ping_pong_has_a_bounded_wait() -> None:
    message, elapsed = _run_two(_hop_main)
    assert "re-plan hop-time ping-pong" in message and "did not complete within 2s" in message, message
    assert elapsed < 12  # the 2 s bound, not a hang until the peer comes back


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])
