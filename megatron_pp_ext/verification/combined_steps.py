"""Which forward and which backward each of megatron's combined forward-backward steps ran, in order.

With MoE all-to-all overlap megatron-core's own interleaved combined 1F1B runs every forward and backward
through its ``combined_forward_backward_step``, and our executor runs each overlap pair and the other ops of
its micro-batches through it (``runtime/combined_step.py``; the rest run megatron's plain steps): a step runs
one forward, one backward, or a forward of one micro-batch with the backward of another. Two runs of the
same schedule must make the same two-sided steps; losses and gradients cannot show it, because the pairing
changes which micro-batch's work overlaps which, not the arithmetic. :func:`recording` lists the steps a
rank makes as ``(forward, backward)``, each side ``(chunk, micro-batch)`` or None; a backward is named by
the forward whose output it consumes (the forward's output tensor is tagged when it is made, and the
backward receives that tensor back).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["Side", "Step", "recording"]

Side = tuple[int, int]  # (chunk of this rank, micro-batch)
Step = tuple[Side | None, Side | None]  # (forward, backward) of one combined step

_TAG = "_megatron_pp_combined_side"  # attribute on a forward's output tensor: its Side


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, list | tuple) else value


@contextlib.contextmanager
def recording(chunks: Sequence[Any]) -> Iterator[list[Step]]:
    """While inside, every call of megatron's ``combined_forward_backward_step`` on this rank appends its
    :data:`Step` to the yielded list. ``chunks``: this rank's model chunks, in chunk order (the modules
    megatron's schedule and our executor pass as ``f_model`` / ``b_model``)."""
    from megatron.core.pipeline_parallel import combined_1f1b

    original = combined_1f1b.combined_forward_backward_step
    index = {id(chunk): i for i, chunk in enumerate(chunks)}
    steps: list[Step] = []

    def recorded(*args: Any, **kwargs: Any) -> Any:
        f_model, b_model, b_output = args[2], args[6], args[8]
        backward = getattr(_first(b_output), _TAG, None) if b_model is not None else None
        result = original(*args, **kwargs)
        forward = None
        if f_model is not None:
            forward = (index.get(id(f_model), -1), int(kwargs.get("current_microbatch", -1)))
            setattr(_first(result[0]), _TAG, forward)
        steps.append((forward, backward))
        return result

    combined_1f1b.combined_forward_backward_step = recorded  # looked up per call by megatron and by us
    try:
        yield steps
    finally:
        combined_1f1b.combined_forward_backward_step = original
