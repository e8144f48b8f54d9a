"""Point-to-point: post transfers, each completing on its own, with bounded waits.

The lowering decides every message; :mod:`.channels` decides when to wait; this module posts
transfers and waits on them. Every transfer gets its own :class:`Handle`. How a backend carries
them is one strategy (:func:`strategy_for`, ``docs/p2p.md``):

* :class:`PerTransfer` (gloo and other backends without coalescing): each send and receive is its
  own ``isend`` / ``irecv``, so a receive completes as soon as its message has landed, whatever
  else was posted with it, and waiting on it never waits on a send;
* :class:`Coalesced` (NCCL): the transfers of one exchange are one ``batch_isend_irecv`` (one NCCL
  group: a send and a receive between the same two peers issued as separate calls could deadlock);
  NCCL returns one work for the batch, which every handle of the batch shares. Its waits make the
  current stream wait for the communication stream (no host wait).

What is and is not checked here:

* every host wait has a timeout (``MEGATRON_PP_P2P_TIMEOUT`` seconds, default 300): a
  message that never arrives fails with the rank and the message instead of hanging; a peer
  that died fails at once, naming the peer and the message (:mod:`.channels` adds every
  transfer still pending on the rank);
* a message carries no description of itself by default: tags are per-channel
  sequence numbers (gloo; NCCL ignores tags), so an activation and a gradient of the
  same shape that cross between two ranks would NOT be noticed here. Ranks that run
  different schedules are caught before the first iteration instead
  (:mod:`.agreement`); with ``--pipeline-check-messages`` (the executor's ``check_messages``, which gives
  each :class:`Transfer` a header) each message is preceded by a small header (kind, stages, micro-batch, sequence)
  that the receiver compares with what it expects when it completes, so a crossed
  message fails where it lands.
"""

from __future__ import annotations

import datetime
import os
import queue
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

TIMEOUT_ENV = "MEGATRON_PP_P2P_TIMEOUT"
_DEFAULT_S = 300.0


def timeout_from_env() -> float:
    """``MEGATRON_PP_P2P_TIMEOUT`` (seconds, finite, > 0; default 300); ValueError naming the variable."""
    from .agreement import parse_timeout

    text = os.environ.get(TIMEOUT_ENV)
    return _DEFAULT_S if text is None else parse_timeout(text, TIMEOUT_ENV)


class PipelineCommError(RuntimeError):
    """A send/receive did not complete (timeout or backend error)."""


@dataclass
class Transfer:
    tensor: torch.Tensor
    peer: int  # global rank
    tag: int
    what: object  # what the message is, for errors and traces: formatted with str() only when shown
    header: tuple[int, ...] = ()  # what the message is (kind, stages, micro-batch, ...): checked on arrival


#: one transfer as a strategy posts it: ``(dist.isend or dist.irecv, tensor, peer, group, tag)``
PostOp = tuple[Callable[..., Any], torch.Tensor, int, "dist.ProcessGroup | None", int]


class Handle:
    """One posted transfer: the work(s) that carry it (its header's too) and its completion."""

    def __init__(
        self,
        transfer: Transfer,
        is_send: bool,
        works: list[Any],
        rank_desc: object,
        timeout_s: float,
        strategy: Strategy,
        header: torch.Tensor | None = None,
    ) -> None:
        self.transfer = transfer
        self.is_send = is_send
        self.works = works
        self.rank_desc = rank_desc
        self.timeout_s = timeout_s
        self.strategy = strategy
        self.header = header  # a receive's header buffer (--pipeline-check-messages)
        self.done = not works
        self.watched: threading.Event | None = None  # set by the completer once the works finished
        self.on_wait: Callable[[Handle], None] | None = None  # told of every wait of the rank on it
        self._outcome: BaseException | bool = True

    @property
    def what(self) -> str:
        t = self.transfer
        return f"send {t.what} to rank {t.peer}" if self.is_send else f"recv {t.what} from rank {t.peer}"

    def is_completed(self) -> bool:
        """Whether it completed, without blocking (a completed receive's header is checked)."""
        if not self.done:
            if self.watched is not None:
                if self.watched.is_set():
                    self._complete("")
            elif all(w.is_completed() for w in self.works):
                self._complete("")
        return self.done

    def wait(self, for_what: object = "") -> None:
        if self.done:
            return
        if self.on_wait is not None:
            self.on_wait(self)
        self._complete(for_what)

    def _complete(self, for_what: object) -> None:
        if self.watched is not None:  # the completer waits on the works; never two waits on one work
            outcome = self._outcome if self.watched.wait(self.timeout_s) else False
        else:
            outcome = self.wait_works()
        if isinstance(outcome, BaseException):
            raise PipelineCommError(self._failure(for_what, outcome)) from outcome
        if outcome is False:
            raise PipelineCommError(
                f"{self.rank_desc}{for_what}: {self.what} did not complete within {self.timeout_s:g}s ({TIMEOUT_ENV})"
            )
        self.done = True
        if self.header is not None:
            got = tuple(int(x) for x in self.header.tolist())
            expected = self.transfer
            if got != expected.header:
                raise PipelineCommError(
                    f"{self.rank_desc}{for_what}: crossed message: expected {expected.what} from rank {expected.peer} "
                    f"(header {expected.header}), the message that arrived has header {got} "
                    "(the ranks run different schedules)"
                )

    def wait_works(self) -> BaseException | bool:
        """Wait on the works themselves: True, False (timed out) or the backend's error."""
        for work in self.works:
            try:
                finished = self.strategy.wait(work, self.timeout_s)
            except RuntimeError as exc:
                return exc
            if finished is False:
                return False
        return True

    def _failure(self, for_what: object, exc: BaseException) -> str:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "timed out" in first.lower() or "timeout" in first.lower():
            return (
                f"{self.rank_desc}{for_what}: {self.what} did not complete within {self.timeout_s:g}s "
                f"({TIMEOUT_ENV}; a peer never posted the matching send/receive): {first}"
            )
        return (
            f"{self.rank_desc}{for_what}: {self.what} failed: a peer closed the connection (it died or exited) "
            f"before the message completed: {first[:300]}"
        )


class Batch:
    """Transfers posted together (:func:`post`); waited on together by callers that want that."""

    def __init__(self, handles: list[Handle]) -> None:
        self.handles = handles

    @property
    def done(self) -> bool:
        return all(h.done for h in self.handles)

    def is_completed(self) -> bool:
        return all([h.is_completed() for h in self.handles])

    def wait(self, for_what: object = "") -> None:
        for handle in self.handles:
            handle.wait(for_what)


class Strategy:
    """How a backend carries transfers (module doc): posting, and what a wait does."""

    #: whether transfers progress on their own, so receives may be posted ahead (the lowering's
    #: prefetch positions) without holding anything else back
    prefetches = True
    #: whether sends are waited for by the :class:`Completer` (works that cannot be polled)
    watches_sends = False

    def post(self, ops: list[PostOp]) -> list[list[Any]]:
        """Post ``ops`` (``(dist.isend or dist.irecv, tensor, peer, group, tag)``); per op, the works that
        carry it."""
        raise NotImplementedError

    def wait(self, work: Any, timeout_s: float) -> Any:
        return work.wait(datetime.timedelta(seconds=timeout_s))


class PerTransfer(Strategy):
    """Each transfer is its own ``isend`` / ``irecv`` (one work each; gloo).

    Gloo's works report completion only through ``wait`` (``is_completed`` stays False until
    then, and a wait that times out breaks the connection), so a caller that wants to know
    whether a send completed without blocking hands it to a :class:`Completer`."""

    watches_sends = True

    def post(self, ops: list[PostOp]) -> list[list[Any]]:
        return [[send_or_recv(tensor, peer, group, tag)] for send_or_recv, tensor, peer, group, tag in ops]


class Completer:
    """Daemon threads, one per peer, that wait for that peer's sends in posting order (a channel
    matches its messages in order) and mark each done (``Handle.watched``). The works' waits
    release the GIL; the owner only reads the flags, or waits on them with its timeout. One
    completer serves one owner (one iteration of the executor): :meth:`close` ends its threads, and
    a thread left waiting on the work of a failed run never holds up another run's sends."""

    def __init__(self) -> None:
        self._queues: dict[int, queue.SimpleQueue[Handle | None]] = {}

    def watch(self, handle: Handle) -> None:
        handle.watched = threading.Event()
        peer = handle.transfer.peer
        inbox = self._queues.get(peer)
        if inbox is None:
            inbox = self._queues[peer] = queue.SimpleQueue()
            threading.Thread(target=self._run, args=(inbox,), name=f"p2p-sends-{peer}", daemon=True).start()
        inbox.put(handle)

    def close(self) -> None:
        """End the threads once they have waited for what they hold."""
        for inbox in self._queues.values():
            inbox.put(None)
        self._queues.clear()

    @staticmethod
    def _run(inbox: queue.SimpleQueue[Handle | None]) -> None:
        while True:
            handle = inbox.get()
            if handle is None:
                return
            try:
                handle._outcome = handle.wait_works()
            except BaseException as exc:  # handed to the main thread, which raises it
                handle._outcome = exc
            finally:
                assert handle.watched is not None
                handle.watched.set()


class Coalesced(Strategy):
    """The transfers posted together are one coalesced batch (one NCCL group, one shared work).

    Receives sit where the rendezvous-checked lowering puts them (no prefetch): the batches run in
    order on one communication stream, where an early receive would hold back the sends after it.
    A wait makes the current (compute) stream wait for the batch's end event and returns: no host
    synchronisation; the process group's own timeout (NCCL watchdog) bounds a transfer that never
    completes."""

    prefetches = False

    def post(self, ops: list[PostOp]) -> list[list[Any]]:
        works = list(dist.batch_isend_irecv([dist.P2POp(*op) for op in ops])) if ops else []
        return [works] * len(ops)

    def wait(self, work: Any, timeout_s: float) -> Any:
        return work.wait()


def strategy_for(group: dist.ProcessGroup | None) -> Strategy:
    """The strategy of the group's backend: :class:`Coalesced` for NCCL, else :class:`PerTransfer`."""
    backend = str(dist.get_backend(group)).lower()
    return Coalesced() if backend == "nccl" else PerTransfer()


def post_transfers(
    sends: Sequence[Transfer],
    recvs: Sequence[Transfer],
    group: dist.ProcessGroup | None,
    *,
    rank_desc: object,
    timeout_s: float | None = None,
    use_tags: bool = True,
    strategy: Strategy | None = None,
    completer: Completer | None = None,
) -> tuple[list[Handle], list[Handle]]:
    """Post ``sends`` and ``recvs`` without waiting: one :class:`Handle` per transfer, in order.

    ``timeout_s``: bound of every host wait on them (None: ``MEGATRON_PP_P2P_TIMEOUT``, default 300 s).
    ``completer``: where the sends go to be waited for, if the strategy cannot poll them.
    """
    timeout_s = timeout_from_env() if timeout_s is None else timeout_s
    if not timeout_s > 0:
        raise ValueError(f"p2p timeout must be > 0 seconds, got {timeout_s!r}")
    strategy = strategy_for(group) if strategy is None else strategy
    ops: list[PostOp] = []
    owner: list[int] = []  # per op: index of its transfer (sends first, then receives)
    headers: dict[int, torch.Tensor] = {}
    for index, (op_kind, t) in enumerate([(dist.isend, t) for t in sends] + [(dist.irecv, t) for t in recvs]):
        tag = t.tag if use_tags else 0
        if t.header:  # a transfer carries one only where messages are checked
            values = t.header if op_kind is dist.isend else (-1,) * len(t.header)
            header = torch.tensor(values, dtype=torch.int64, device=t.tensor.device)
            if op_kind is dist.irecv:
                headers[index] = header
            ops.append((op_kind, header, t.peer, group, tag))
            owner.append(index)
        ops.append((op_kind, t.tensor, t.peer, group, tag))
        owner.append(index)
    if not ops:
        return [], []
    try:
        works = strategy.post(ops)
    except RuntimeError as exc:
        raise PipelineCommError(f"{rank_desc}: posting {_describe(sends, recvs)} failed: {exc}") from exc
    per_transfer: list[list[Any]] = [[] for _ in range(len(sends) + len(recvs))]
    for index, carried in zip(owner, works, strict=True):
        per_transfer[index] += [w for w in carried if all(w is not x for x in per_transfer[index])]
    handles = [
        Handle(t, index < len(sends), per_transfer[index], rank_desc, timeout_s, strategy, headers.get(index))
        for index, t in enumerate([*sends, *recvs])
    ]
    if strategy.watches_sends and completer is not None:
        for handle in handles[: len(sends)]:
            completer.watch(handle)
    return handles[: len(sends)], handles[len(sends) :]


def post(
    sends: Sequence[Transfer],
    recvs: Sequence[Transfer],
    group: dist.ProcessGroup | None,
    *,
    rank_desc: str,
    timeout_s: float | None = None,
    use_tags: bool = True,
) -> Batch:
    """:func:`post_transfers` as one :class:`Batch` (for callers that wait for everything at once)."""
    send_handles, recv_handles = post_transfers(
        sends, recvs, group, rank_desc=rank_desc, timeout_s=timeout_s, use_tags=use_tags
    )
    return Batch(send_handles + recv_handles)


def _describe(sends: Sequence[Transfer], recvs: Sequence[Transfer]) -> str:
    parts = [f"send {t.what} to rank {t.peer}" for t in sends] + [f"recv {t.what} from rank {t.peer}" for t in recvs]
    return "[" + "; ".join(parts) + "]"
