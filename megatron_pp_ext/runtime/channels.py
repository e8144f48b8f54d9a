"""The executor's p2p protocol on one rank: when a transfer is waited for, and what it holds.

The lowering places every send and receive (:mod:`megatron_pp_ext.schedules.lowering`); this
module keeps, for one iteration, what was posted and completes it off the critical path:

* a receive is posted where the lowering says (its prefetch position on a backend whose transfers
  progress on their own, see :mod:`.p2p`) and waited for only by its consumer, just before that op
  runs: an op never waits for anything but its own input;
* a send is pending from its posting until it completes. Completed sends are retired whenever the
  rank posts (``is_completed``, no wait). A send is waited for only (a) before the buffer it reads is
  freed: megatron's pseudo-free of a forward output that was sent, before that output's backward
  (after the backward's own input arrived, by when the receiver has posted its receive), (b) at
  the end of the iteration, and (c) when more than the lowering's bound of sends are pending
  (``LoweredSchedule.send_bounds``, checked not to deadlock): then the oldest ones.

A wait that fails (timeout, dead peer) names the rank, the op it was for, and every transfer still
pending on the rank. Receive buffers count as live memory from their posting until their consumer
takes them; pending sends' bytes are measured apart (:mod:`.trace`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..schedules.lowering import GRAD, Message
from . import p2p
from .trace import NullTracer


@dataclass
class _Send:
    msg: Message
    handle: p2p.Handle
    tensor: torch.Tensor
    nbytes: int
    free: bool  # pseudo-free the tensor (a sent forward output) once the send completed


@dataclass
class _Recv:
    msg: Message
    handle: p2p.Handle
    nbytes: int


class Channels:
    """This rank's posted transfers in one iteration (module doc)."""

    def __init__(
        self,
        *,
        group: Any,
        global_ranks: Sequence[int],
        timeout_s: float,
        use_tags: bool,
        send_bound: int | None,
        tracer: NullTracer,
        free: Callable[[torch.Tensor], None],
        check_messages: bool = False,
    ) -> None:
        self.group = group
        self.check_messages = check_messages  # a header with every message, checked on arrival
        self.global_ranks = list(global_ranks)
        self.timeout_s = timeout_s
        self.use_tags = use_tags
        self.send_bound = send_bound
        self.tracer = tracer
        self.free = free
        self.strategy = p2p.strategy_for(group)
        self.completer = p2p.Completer() if self.strategy.watches_sends else None
        self.recvs: dict[tuple[str, int, int], _Recv] = {}
        self.sends: list[_Send] = []

    @property
    def prefetches(self) -> bool:
        """Whether receives go to the lowering's prefetch positions on this backend."""
        return self.strategy.prefetches

    def post(
        self,
        sends: Sequence[tuple[Message, torch.Tensor, bool]],
        recvs: Sequence[tuple[Message, torch.Tensor]],
        where: object,
    ) -> None:
        """Post ``(message, tensor, free once sent)`` sends and ``(message, buffer)`` receives. ``where``: the
        error context (formatted only if an error needs it)."""
        checks = self.check_messages  # a header per message only when they are checked
        transfers = [
            p2p.Transfer(t, self.global_ranks[m.dst_rank], m.seq, m, header(m) if checks else ()) for m, t, _ in sends
        ]
        buffers = [
            p2p.Transfer(b, self.global_ranks[m.src_rank], m.seq, m, header(m) if checks else ()) for m, b in recvs
        ]
        self.tracer.begin_comm()
        try:
            send_handles, recv_handles = p2p.post_transfers(
                transfers,
                buffers,
                self.group,
                rank_desc=where,
                timeout_s=self.timeout_s,
                use_tags=self.use_tags,
                strategy=self.strategy,
                completer=self.completer,
            )
        finally:
            self.tracer.end_comm()
        for handle in (*send_handles, *recv_handles):
            handle.on_wait = self._traced_wait
        for (msg, tensor, free), handle in zip(sends, send_handles, strict=True):
            nbytes = tensor.numel() * tensor.element_size()
            self.sends.append(_Send(msg, handle, tensor, nbytes, free))
            self.tracer.add_send_bytes(nbytes)
            self.tracer.protocol("send-post", msg)
        for (msg, buffer), handle in zip(recvs, recv_handles, strict=True):
            nbytes = buffer.numel() * buffer.element_size()
            self.recvs[msg.key] = _Recv(msg, handle, nbytes)
            self.tracer.add_comm_bytes(nbytes)
            self.tracer.protocol("recv-post", msg)
        self.retire_completed()
        if self.send_bound is not None and len(self.sends) > self.send_bound:
            self.retire_completed()
            while len(self.sends) > self.send_bound:
                pending = f", with {len(self.sends)} sends pending (bound {self.send_bound})"
                self._wait_send(self.sends[0], "bound", pending)

    def wait_input(self, key: tuple[str, int, int], for_what: object) -> bool:
        """Wait for the receive that brings mailbox entry ``key`` (if one is pending); True if one was."""
        recv = self.recvs.pop(key, None)
        if recv is None:
            return False
        waited = self._guarded(recv.handle, for_what)
        self.tracer.add_comm_bytes(-recv.nbytes)
        self.tracer.protocol("recv-wait", recv.msg, waited_s=waited)
        return True

    def finish_send_of(self, tensor: Any, for_what: object) -> None:
        """Complete the send that reads ``tensor`` (before its buffer is freed)."""
        for send in self.sends:
            if send.tensor is tensor:
                self._wait_send(send, "free", for_what)
                break

    def retire_completed(self) -> None:
        """Retire the sends that completed, without waiting."""
        try:
            completed = [s for s in self.sends if s.handle.is_completed()]
        except p2p.PipelineCommError as exc:
            raise p2p.PipelineCommError(f"{exc}; pending on this rank: {self.pending()}") from exc
        for send in completed:
            self._retire(send, "polled", 0.0)

    def finish(self) -> list[str]:
        """End of the iteration: wait for every send; the receives nobody took (names)."""
        while self.sends:
            self._wait_send(self.sends[0], "end", ", at the end of the iteration")
        if self.completer is not None:
            self.completer.close()
        return [f"unconsumed receive {key}" for key in self.recvs]

    def pending(self) -> str:
        """Every transfer still pending on this rank, for error messages."""
        parts = [s.handle.what for s in self.sends if not s.handle.done]
        parts += [r.handle.what for r in self.recvs.values() if not r.handle.done]
        return "; ".join(parts[:16]) + (f"; ... ({len(parts) - 16} more)" if len(parts) > 16 else "") or "none"

    # ---- helpers -----------------------------------------------------------------------------
    def _wait_send(self, send: _Send, reason: str, for_what: object) -> None:
        waited = self._guarded(send.handle, for_what)
        self._retire(send, reason, waited)

    def _retire(self, send: _Send, how: str, waited: float) -> None:
        self.sends.remove(send)
        self.tracer.add_send_bytes(-send.nbytes)
        self.tracer.protocol("send-done", send.msg, how=how, waited_s=waited)
        if send.free:
            self.free(send.tensor)

    def _traced_wait(self, handle: p2p.Handle) -> None:
        """Every wait of the rank on a transfer, whoever waits (the trace's guard)."""
        self.tracer.protocol("wait", handle.transfer.what, send=handle.is_send)

    def _guarded(self, handle: p2p.Handle, for_what: object) -> float:
        """Wait for ``handle``; the seconds waited. A failure names every transfer still pending on
        the rank."""
        try:
            start = time.perf_counter()
            handle.wait(for_what)
            return time.perf_counter() - start
        except p2p.PipelineCommError as exc:
            raise p2p.PipelineCommError(f"{exc}; pending on this rank: {self.pending()}") from exc


def header(msg: Message) -> tuple[int, ...]:
    """What a message is, as checked on arrival with ``--pipeline-check-messages``."""
    return (int(msg.kind == GRAD), msg.src_stage, msg.dst_stage, msg.microbatch, msg.seq)
