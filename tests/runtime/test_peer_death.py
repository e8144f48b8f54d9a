"""Bounded waits: a peer that dies is named at once; a peer that never answers the re-plan's ping-pong
fails it after the timeout instead of hanging.

No assertion here reads the wall clock against a figure taken from one machine: which mechanism ended
the wait (the peer's closed connection, or the timeout) is named by the message itself, and a silent
peer is kept alive by an event until the survivor has reported, so the timeout is the only way out
whatever the load. The one time assertion left is a lower bound that follows from the configuration
(a timeout of T seconds cannot fire before T seconds)."""

from __future__ import annotations

import datetime
import os
import socket
import time
from typing import Any

import pytest

pytestmark = pytest.mark.gloo  # every test runs two gloo ranks of its own


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
        message, _ = out.get(timeout=120)
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
    assert "did not complete within" not in message  # the closed connection ended it, not the 300 s timeout


def _hop_main(rank: int, init_method: str, out: Any, reported: Any) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    from megatron_pp_ext.runtime import p2p
    from megatron_pp_ext.runtime.replan import measure_hop_time

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip
    if rank == 1:
        reported.wait(120)  # busy elsewhere (another schedule): never joins the ping-pong
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
    """Runs ``target(rank, init_method, out, reported)`` on two ranks; ``reported`` is set once rank 0's
    result has arrived, so a peer that plays dead stays alive exactly until then."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    reported = ctx.Event()
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=target, args=(r, init_method, out, reported), daemon=True) for r in range(2)]
    for proc in procs:
        proc.start()
    try:
        return out.get(timeout=120)
    finally:
        reported.set()
        for proc in procs:
            proc.join(timeout=20)
            if proc.is_alive():
                proc.kill()


def test_replan_ping_pong_has_a_bounded_wait() -> None:
    message, elapsed = _run_two(_hop_main)
    assert "re-plan hop-time ping-pong" in message and "did not complete within 2s" in message, message
    assert elapsed >= 2.0  # the configured timeout, not an early give-up


def _pending_send_main(rank: int, init_method: str, out: Any, reported: Any, mode: str = "dies") -> None:
    """Rank 0 posts a send to rank 1 and a receive from it, as the executor's protocol does, then
    reaches the end of its iteration. Rank 1 dies without posting anything (``dies``), or stays
    alive and never answers (``silent``)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist

    from megatron_pp_ext.runtime import p2p
    from megatron_pp_ext.runtime.channels import Channels
    from megatron_pp_ext.runtime.trace import NullTracer
    from megatron_pp_ext.schedules.lowering import ACT, GRAD, Message

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip
    dist.barrier()
    if rank == 1:
        if mode == "dies":
            time.sleep(0.5)
            os._exit(17)  # dies with rank 0's send to it pending
        reported.wait(120)  # alive, never posts the receive nor the send
        os._exit(0)
    channels = Channels(group=None, global_ranks=[0, 1], timeout_s=3.0 if mode == "silent" else 300.0,
                        use_tags=True, send_bound=None, tracer=NullTracer(), free=lambda t: None)  # fmt: skip
    sent = Message(ACT, 0, 1, 3, 0, 1, 0)
    expected = Message(GRAD, 1, 0, 2, 1, 0, 0)
    start = time.monotonic()
    try:
        channels.post(
            [(sent, torch.ones(4), False)], [(expected, torch.empty(4))], "pipeline rank 0, exchange before F0.4"
        )
        channels.finish()
        out.put(("no error", time.monotonic() - start))
    except p2p.PipelineCommError as exc:
        out.put((str(exc), time.monotonic() - start))
    out.close()
    out.join_thread()
    os._exit(0)


def _pending_send_to_dead_peer(rank: int, init_method: str, out: Any, reported: Any) -> None:
    _pending_send_main(rank, init_method, out, reported, "dies")


def _pending_send_to_silent_peer(rank: int, init_method: str, out: Any, reported: Any) -> None:
    _pending_send_main(rank, init_method, out, reported, "silent")


def test_pending_send_to_a_dead_peer_fails_at_once_naming_it() -> None:
    message, _ = _run_two(_pending_send_to_dead_peer)
    assert "pipeline rank 0, exchange before F0.4, at the end of the iteration: " in message, message
    assert "send act[0->1 mb3 r0->r1] to rank 1 failed: a peer closed the connection" in message, message
    assert "pending on this rank: " in message and "recv grad[1->0 mb2 r1->r0] from rank 1" in message, message
    assert "did not complete within" not in message  # the closed connection ended it, not the 300 s timeout


def test_pending_send_to_a_silent_peer_fails_after_the_timeout() -> None:
    message, elapsed = _run_two(_pending_send_to_silent_peer)
    assert "pipeline rank 0, exchange before F0.4, at the end of the iteration: " in message, message
    assert "send act[0->1 mb3 r0->r1] to rank 1 did not complete within 3s" in message, message
    assert "pending on this rank: " in message and "recv grad[1->0 mb2 r1->r0] from rank 1" in message, message
    assert elapsed >= 3.0  # the configured timeout, not an early give-up


if __name__ == "__main__":  # pragma: no cover
    pytest.main([__file__])
