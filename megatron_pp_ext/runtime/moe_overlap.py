"""An overlap hook for MoE chunks (:mod:`.overlap`): a forward's all-to-all in flight during the paired backward.

DualPipeV pairs one micro-batch's forward with another's backward on the same rank. With
:class:`MoEOverlapHook` on a chunk, the pair's forward runs until its first expert-parallel all-to-all
(the token dispatch of the chunk's first MoE layer), launches it asynchronously, runs the whole paired
backward while the tokens travel, then waits for them and finishes the forward. One hole per pair: the
later all-to-alls of the forward (the combine, the next layers) run as megatron runs them.

How: while a hook runs a pair, megatron's ``_AllToAll.forward`` (``tensor_parallel/mappings.py``) is
replaced by a copy that issues the same ``all_to_all_single`` (same buffers, same split sizes, same
group) with ``async_op=True`` and runs the backward before ``wait()``. The arithmetic is megatron's:
the pair's two ops compute what they compute when run one after the other; only their order on the
rank changes, the backward ending first (as the executor's overlap contract allows). Every rank of an
expert-parallel group runs the same op list and the same hook, so the group issues its collectives in
the same order on every rank.

Without expert parallelism (a group of one rank megatron's all-to-all is the identity) or in a chunk
without MoE layers no all-to-all runs, and the hook runs the two ops one after the other.

``events`` records, per pair, ``("a2a-launch", forward)``, ``("backward", backward)``, ``("a2a-wait",
forward)`` (or ``("serial", backward)`` when no all-to-all opened a hole): the order the tests check.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .overlap import HOOK_ATTRIBUTE, OverlapStep

__all__ = ["MoEOverlapHook", "install_moe_overlap"]


class _Hole:
    """The backward waiting for the pair's forward to reach its first all-to-all."""

    def __init__(self, hook: MoEOverlapHook, forward: OverlapStep, backward: OverlapStep) -> None:
        self.hook, self.forward, self.backward = hook, forward, backward
        self.done = False


_ACTIVE: list[_Hole] = []
_ORIGINAL: Any = None


class MoEOverlapHook:
    """The overlap hook of one MoE model chunk (see the module docstring)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def __call__(self, forward: OverlapStep, backward: OverlapStep) -> None:
        hole = _Hole(self, forward, backward)
        with _holding(hole):
            forward.run()
        if not hole.done:  # no all-to-all in this forward: one after the other
            self.events.append(("serial", str(backward.op)))
            backward.run()


@contextlib.contextmanager
def _holding(hole: _Hole) -> Iterator[None]:
    _install()
    _ACTIVE.append(hole)
    try:
        yield
    finally:
        _ACTIVE.pop()


def _install() -> None:
    """Replace megatron's ``_AllToAll.forward`` once (idempotent); outside a hook it is megatron's."""
    global _ORIGINAL
    from megatron.core.tensor_parallel import mappings

    if _ORIGINAL is not None:
        return
    _ORIGINAL = mappings._AllToAll.forward
    mappings._AllToAll.forward = staticmethod(_all_to_all_forward)  # type: ignore[method-assign,assignment]


def _all_to_all_forward(
    ctx: Any, group: Any, input: Any, output_split_sizes: Any, input_split_sizes: Any, use_nccl_stream: bool = False
) -> Any:
    """megatron's ``_AllToAll.forward``; inside a pair's forward, its first multi-rank all-to-all is
    launched asynchronously and the pair's backward runs before the wait."""
    import torch

    hole = _ACTIVE[-1] if _ACTIVE else None
    if hole is None or hole.done or group.size() == 1:
        return _ORIGINAL(ctx, group, input, output_split_sizes, input_split_sizes, use_nccl_stream)
    ctx.group = group
    ctx.output_split_sizes = output_split_sizes
    ctx.input_split_sizes = input_split_sizes
    ctx.use_nccl_stream = use_nccl_stream
    input = input.contiguous()
    if output_split_sizes is None:
        output = torch.empty_like(input)
    else:
        output = input.new_empty(size=[sum(output_split_sizes), *input.size()[1:]], dtype=input.dtype)
    work = torch.distributed.all_to_all_single(
        output,
        input,
        output_split_sizes=output_split_sizes,
        input_split_sizes=input_split_sizes,
        group=group,
        async_op=True,
    )
    hole.done = True
    events = hole.hook.events
    events.append(("a2a-launch", str(hole.forward.op)))
    with torch.enable_grad():  # an autograd function's forward runs without grad mode; a backward needs it
        hole.backward.run()
    events.append(("backward", str(hole.backward.op)))
    work.wait()
    events.append(("a2a-wait", str(hole.forward.op)))
    return output


def install_moe_overlap(chunks: list[Any]) -> list[MoEOverlapHook]:
    """Give every model chunk its own :class:`MoEOverlapHook` (the executor finds it through wrappers);
    returns the hooks (their ``events``)."""
    hooks = []
    for chunk in chunks:
        hook = MoEOverlapHook()
        setattr(chunk, HOOK_ATTRIBUTE, hook)
        hooks.append(hook)
    return hooks
