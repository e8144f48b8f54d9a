"""The overlap hook: how a model chunk runs a forward and a backward together.

A schedule marks overlap pairs (:attr:`~megatron_pp_ext.schedules.schedule.Schedule.overlap_pairs`,
DualPipe's forward-and-backward steps): one forward and one backward of different micro-batches, on
one rank, whose inputs the lowering receives before the pair. Where the chunk that runs the pair's
forward has an attribute :data:`HOOK_ATTRIBUTE` (on the chunk itself or on a module it wraps, e.g. under
megatron's DDP), the executor calls it once per pair::

    chunk.overlapped_forward_backward(forward: OverlapStep, backward: OverlapStep) -> None

Each step carries its op, the model chunk running it, and ``run()``, which performs the executor's
whole step (megatron's ``forward_step`` or ``backward_step``, the mailbox, and for the pair's first op
the sends that follow it). The hook must call each ``run()`` exactly once, in any order or
interleaved with its own work: DeepSeek's DualPipe overlaps one micro-batch's MoE all-to-all with the
other's attention this way. Without a hook the executor runs the two ops one after the other, which
is what :func:`serial` does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from ..schedules.ir import Op

__all__ = ["HOOK_ATTRIBUTE", "OverlapHook", "OverlapStep", "find_overlap_hook", "serial"]

HOOK_ATTRIBUTE = "overlapped_forward_backward"


class OverlapStep(NamedTuple):
    """One op of an overlap pair, as the executor hands it to a hook."""

    op: Op
    model: Any  # the model chunk running it (as the executor was given it)
    run: Callable[[], None]


OverlapHook = Callable[[OverlapStep, OverlapStep], None]


def serial(forward: OverlapStep, backward: OverlapStep) -> None:
    """The default: the forward, then the backward."""
    forward.run()
    backward.run()


def find_overlap_hook(model: Any, max_depth: int = 8) -> OverlapHook | None:
    """The chunk's overlap hook: :data:`HOOK_ATTRIBUTE` on ``model`` or on the modules it wraps
    (``.module`` chain, as megatron's DDP and Float16Module wrap), else ``None``."""
    for _ in range(max_depth):
        if model is None:
            return None
        hook = getattr(model, HOOK_ATTRIBUTE, None)
        if callable(hook):
            return hook  # type: ignore[no-any-return]
        model = getattr(model, "module", None)
    return None
