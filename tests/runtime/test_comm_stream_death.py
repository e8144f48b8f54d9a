"""An expert-parallel all-to-all in flight on CPU mode's communication stream (integration/cpu_streams.py)
whose peer dies, or stays silent: the host's wait ends with the node named, by the closed connection or
after the bounded timeout (``MEGATRON_PP_P2P_TIMEOUT``), never a hang.

As in test_peer_death.py, which mechanism ended the wait is read from the message, and a silent peer is
kept alive until the survivor has reported, so the timeout is the only way out."""

from __future__ import annotations

import datetime
import os
import socket
import time
from typing import Any

import pytest

pytestmark = pytest.mark.gloo  # two gloo ranks of its own


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, init_method: str, out: Any, reported: Any, mode: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MEGATRON_PP_P2P_TIMEOUT"] = "3"
    from megatron_pp_ext.integration.cpu import enable_cpu_mode

    enable_cpu_mode(force=True)
    import torch
    import torch.distributed as dist
    from megatron.core.pipeline_parallel import utils

    from megatron_pp_ext.runtime.errors import CommStreamError

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip
    dist.barrier()
    if rank == 1:
        if mode == "dies":
            time.sleep(0.5)
            os._exit(17)  # never joins the all-to-all
        reported.wait(120)  # alive, busy elsewhere
        os._exit(0)

    def all_to_all(tokens: Any) -> Any:
        output = torch.empty_like(tokens)
        dist.all_to_all_single(output, tokens)
        return output

    utils.set_streams()
    event = torch.cuda.Event()
    dispatch = utils.ScheduleNode(all_to_all, utils.get_comm_stream, event, name="moe_dispatch")
    experts = utils.ScheduleNode(lambda x: x * 2, utils.get_comp_stream, event, name="mlp")
    start = time.monotonic()
    try:
        experts.forward(dispatch.forward(torch.ones(4, requires_grad=True)))
        out.put(("no error", time.monotonic() - start))
    except CommStreamError as exc:
        out.put((str(exc), time.monotonic() - start))
    out.close()
    out.join_thread()
    os._exit(0)  # the worker thread may still sit in gloo's collective: leave without teardown


def _run_two(mode: str) -> tuple[str, float]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    reported = ctx.Event()
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    procs = [ctx.Process(target=_rank_main, args=(r, init_method, out, reported, mode), daemon=True) for r in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        return out.get(timeout=180)
    finally:
        reported.set()
        for proc in procs:
            proc.join(timeout=20)
            if proc.is_alive():
                proc.kill()


def test_dead_peer_ends_the_wait_naming_the_node() -> None:
    message, _ = _run_two("dies")
    assert "moe_dispatch (forward) on megatron's communication stream failed" in message, message
    assert "did not finish within" not in message  # the closed connection ended it


def test_silent_peer_ends_the_wait_after_the_bound() -> None:
    message, elapsed = _run_two("silent")
    assert "moe_dispatch (forward) on megatron's communication stream did not finish within 3 s" in message, message
    assert elapsed >= 3.0  # the configured bound, not an early give-up
