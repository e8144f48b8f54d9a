"""Point-to-point: post one lowered ``Exchange`` batch, wait for it later, with a timeout.

The lowering decides every message; this module only posts them: all sends and
receives of one batch go out together through ``batch_isend_irecv`` and complete
together (NCCL coalesces a batch). The executor waits on a batch only when an op
needs one of its receives, or before freeing what it sent.

What is and is not checked here:

* every wait has a timeout (``MEGATRON_PP_P2P_TIMEOUT`` seconds, default 300): a
  message that never arrives fails with the rank and the pending messages instead
  of hanging; a peer that died fails at once, naming the peer and the messages;
* a message carries no description of itself by default: tags are per-channel
  sequence numbers (gloo; NCCL ignores tags), so an activation and a gradient of the
  same shape that cross between two ranks would NOT be noticed here. Ranks that run
  different schedules are caught before the first iteration instead
  (:mod:`.agreement`); with :func:`set_check_messages` (``--pipeline-check-messages``)
  each message is preceded by a small header (kind, stages, micro-batch, sequence)
  that the receiver compares with what it expects, so a crossed message fails where
  it lands.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

TIMEOUT_ENV = "MEGATRON_PP_P2P_TIMEOUT"
_DEFAULT_S = 300.0
_check_messages = False


def timeout_from_env() -> float:
    """``MEGATRON_PP_P2P_TIMEOUT`` (seconds, finite, > 0; default 300); ValueError naming the variable."""
    from .agreement import parse_timeout

    text = os.environ.get(TIMEOUT_ENV)
    return _DEFAULT_S if text is None else parse_timeout(text, TIMEOUT_ENV)


def __getattr__(name: str) -> float:
    if name == "DEFAULT_TIMEOUT_S":  # read when used, so a bad value fails with its name, not at import
        return timeout_from_env()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def set_check_messages(enabled: bool) -> None:
    """``--pipeline-check-messages``: send a header with every message and check it on arrival."""
    global _check_messages
    _check_messages = enabled


class PipelineCommError(RuntimeError):
    """A send/receive did not complete (timeout or backend error)."""


@dataclass
class Transfer:
    tensor: torch.Tensor
    peer: int  # global rank
    tag: int
    what: str  # human-readable description for errors
    header: tuple[int, ...] = ()  # what the message is (kind, stages, micro-batch, ...): checked on arrival


class Batch:
    """One posted batch: its works complete together (NCCL coalesces a batch into one work)."""

    def __init__(
        self,
        works: list[Any],
        what: str,
        rank_desc: str,
        timeout_s: float,
        headers: Sequence[tuple[Transfer, torch.Tensor]] = (),
    ) -> None:
        self.works = works
        self.what = what
        self.rank_desc = rank_desc
        self.timeout_s = timeout_s
        self.headers = list(headers)  # (expected receive, header buffer it arrived with)
        self.done = not works

    def is_completed(self) -> bool:
        if not self.done and all(w.is_completed() for w in self.works):
            self.wait()
        return self.done

    def wait(self, for_what: str = "") -> None:
        if self.done:
            return
        timeout = datetime.timedelta(seconds=self.timeout_s)
        for work in self.works:
            try:
                finished = work.wait(timeout)
            except RuntimeError as exc:
                raise PipelineCommError(self._failure(for_what, exc)) from exc
            if finished is False:
                raise PipelineCommError(
                    f"{self.rank_desc}{for_what}: {self.what} did not complete within {self.timeout_s:g}s "
                    f"({TIMEOUT_ENV})"
                )
        self.done = True
        for expected, header in self.headers:
            got = tuple(int(x) for x in header.tolist())
            if got != expected.header:
                raise PipelineCommError(
                    f"{self.rank_desc}{for_what}: crossed message: expected {expected.what} from rank {expected.peer} "
                    f"(header {expected.header}), the message that arrived has header {got} "
                    "(the ranks run different schedules)"
                )

    def _failure(self, for_what: str, exc: BaseException) -> str:
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


def post(
    sends: Sequence[Transfer],
    recvs: Sequence[Transfer],
    group: dist.ProcessGroup | None,
    *,
    rank_desc: str,
    timeout_s: float | None = None,
    use_tags: bool = True,
) -> Batch:
    """Post ``sends`` and ``recvs`` as one batch without waiting; wait on the returned :class:`Batch`.

    ``timeout_s``: bound of every wait on the batch (None: ``MEGATRON_PP_P2P_TIMEOUT``, default 300 s).
    """
    timeout_s = timeout_from_env() if timeout_s is None else timeout_s
    if not timeout_s > 0:
        raise ValueError(f"p2p timeout must be > 0 seconds, got {timeout_s!r}")
    ops: list[dist.P2POp] = []
    headers: list[tuple[Transfer, torch.Tensor]] = []
    for op_kind, transfers in ((dist.isend, sends), (dist.irecv, recvs)):
        for t in transfers:
            tag = t.tag if use_tags else 0
            if _check_messages and t.header:
                values = t.header if op_kind is dist.isend else (-1,) * len(t.header)
                header = torch.tensor(values, dtype=torch.int64, device=t.tensor.device)
                if op_kind is dist.irecv:
                    headers.append((t, header))
                ops.append(dist.P2POp(op_kind, header, t.peer, group, tag))
            ops.append(dist.P2POp(op_kind, t.tensor, t.peer, group, tag))
    what = _describe(sends, recvs)
    if not ops:
        return Batch([], what, rank_desc, timeout_s)
    try:
        works = list(dist.batch_isend_irecv(ops))
    except RuntimeError as exc:
        raise PipelineCommError(f"{rank_desc}: posting {what} failed: {exc}") from exc
    return Batch(works, what, rank_desc, timeout_s, headers)


def _describe(sends: Sequence[Transfer], recvs: Sequence[Transfer]) -> str:
    parts = [f"send {t.what} to rank {t.peer}" for t in sends] + [f"recv {t.what} from rank {t.peer}" for t in recvs]
    return "[" + "; ".join(parts) + "]"
