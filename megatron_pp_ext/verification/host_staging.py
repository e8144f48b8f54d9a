"""Pipeline ranks sharing one GPU: their device set-up, and p2p of CUDA tensors over gloo via host memory.

Two pipeline ranks can share one GPU only over gloo: NCCL refuses two ranks on one device. gloo reduces
and broadcasts CUDA tensors itself, but its send and receive take host memory only. :func:`install`
replaces ``torch.distributed.batch_isend_irecv`` (the one entry that megatron's batched p2p and this
package's executor both post through) with a version that copies every CUDA tensor it sends to the host
first, receives every CUDA tensor into a host buffer, and copies that buffer into the CUDA tensor when
the receive is waited on. CPU tensors pass through untouched, so installing it on a CPU run changes
nothing. It also makes ``torch.distributed.all_reduce`` over a group of one rank return at once: megatron
DDP's gradient all-reduce over the (size-one) data-parallel group runs inside a coalescing manager, which
ends in ``allreduce_coalesced``, and gloo refuses that for CUDA tensors ("unsupported device type"); over
one rank a reduction is the identity. Used by ``verify`` with ``device="cuda"`` (the GPU check's
pipeline on one GPU); never by a training run. :func:`prepare_rank` sets a ``verify`` rank up for its
device, :func:`to_cpu` brings its results back to host memory (they travel to the driver through a queue).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_ORIGINAL: Any = None
_ORIGINAL_ALL_REDUCE: Any = None
_STAGE_ALL = False  # testing aid: stage CPU tensors too, so that a CPU run exercises this code


class _StagedRecv:
    """A receive into a host buffer; ``wait`` completes it into the CUDA tensor (once)."""

    def __init__(self, work: Any, host: torch.Tensor, target: torch.Tensor) -> None:
        self.work, self.host, self.target = work, host, target
        self.copied = False

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        finished = self.work.wait(*args, **kwargs)
        if finished is not False and not self.copied:
            with torch.no_grad():
                self.target.copy_(self.host)
            self.copied = True
        return finished

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


class _StagedSend:
    """A send of a host copy; keeps the copy alive until the send is waited on."""

    def __init__(self, work: Any, host: torch.Tensor) -> None:
        self.work, self.host = work, host

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        return self.work.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        return bool(self.work.is_completed())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


def _staged(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cuda" or _STAGE_ALL


def staged_batch_isend_irecv(p2p_op_list: list[Any]) -> list[Any]:
    """``batch_isend_irecv`` with CUDA tensors staged through host buffers (see the module doc)."""
    staged: list[Any] = []
    wrappers: list[tuple[bool, torch.Tensor, torch.Tensor] | None] = []
    for op in p2p_op_list:
        tensor = op.tensor
        if not _staged(tensor):
            staged.append(op)
            wrappers.append(None)
            continue
        sending = op.op is dist.isend
        if sending:
            host = tensor.detach().to("cpu", copy=True)  # synchronous: the data is final when the send is posted
        else:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        staged.append(dist.P2POp(op.op, host, op.peer, op.group, op.tag))
        wrappers.append((sending, host, tensor))
    works = list(_ORIGINAL(staged))
    if len(works) != len(staged):
        raise RuntimeError(
            f"host staging: the backend returned {len(works)} work(s) for {len(staged)} messages (it coalesces "
            "the batch); staging needs one work per message, as gloo gives"
        )
    out: list[Any] = []
    for work, wrapper in zip(works, wrappers, strict=True):
        if wrapper is None:
            out.append(work)
        elif wrapper[0]:
            out.append(_StagedSend(work, wrapper[1]))
        else:
            out.append(_StagedRecv(work, wrapper[1], wrapper[2]))
    return out


class _NothingToWaitFor:
    """The work of a collective that had nothing to do."""

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def all_reduce_skipping_single_rank(tensor: torch.Tensor, op: Any = None, group: Any = None, async_op: bool = False):
    """``all_reduce``, returning at once over a group of one rank (see the module doc)."""
    if group is not None and dist.get_world_size(group) == 1:
        return _NothingToWaitFor() if async_op else None
    if op is None:
        return _ORIGINAL_ALL_REDUCE(tensor, group=group, async_op=async_op)
    return _ORIGINAL_ALL_REDUCE(tensor, op=op, group=group, async_op=async_op)


def install(stage_cpu_tensors: bool = False) -> None:
    """Route ``torch.distributed.batch_isend_irecv`` through host staging (idempotent).

    ``stage_cpu_tensors``: copy CPU tensors through separate host buffers as well (the CPU dry run of the
    GPU check uses it to run this module's code without a GPU)."""
    global _ORIGINAL, _ORIGINAL_ALL_REDUCE, _STAGE_ALL
    _STAGE_ALL = stage_cpu_tensors
    if _ORIGINAL is None:
        _ORIGINAL = dist.batch_isend_irecv
        _ORIGINAL_ALL_REDUCE = dist.all_reduce
    dist.batch_isend_irecv = staged_batch_isend_irecv  # type: ignore[assignment]
    dist.all_reduce = all_reduce_skipping_single_rank  # type: ignore[assignment]


def uninstall() -> None:
    global _ORIGINAL, _ORIGINAL_ALL_REDUCE, _STAGE_ALL
    _STAGE_ALL = False
    if _ORIGINAL is not None:
        dist.batch_isend_irecv = _ORIGINAL  # type: ignore[assignment]
        dist.all_reduce = _ORIGINAL_ALL_REDUCE  # type: ignore[assignment]
        _ORIGINAL = _ORIGINAL_ALL_REDUCE = None


DEVICES = ("cpu", "cuda")


def prepare_rank(device: str, stage_p2p_through_host: bool = False) -> None:
    """CPU shims (forced even where CUDA exists), or GPU 0 with host-staged p2p.

    A process keeps the device of its first run: the CPU shims cannot be undone."""
    from megatron_pp_ext.integration.cpu import enable_cpu_mode, hide_missing_accelerator_warnings, is_enabled

    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    hide_missing_accelerator_warnings(announce=False)  # before enable_cpu_mode imports megatron
    if device == "cpu":
        enable_cpu_mode(force=True)
    else:
        if is_enabled():
            raise RuntimeError("this rank process ran a CPU run before: use a fresh RankPool for device 'cuda'")
        torch.cuda.set_device(0)
    if device == "cuda" or stage_p2p_through_host:
        install(stage_cpu_tensors=device == "cpu")
    else:
        uninstall()


def to_cpu(value: Any) -> Any:
    """``value`` with every tensor in it (through dicts and lists) moved to host memory."""
    if isinstance(value, torch.Tensor):
        return value.cpu() if value.device.type != "cpu" else value
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_cpu(v) for v in value]
    return value
