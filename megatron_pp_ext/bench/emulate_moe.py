"""The emulated bench's MoE ranks (``bench --emulate --a2a-ms T --overlap-moe-expert-parallel-comm``): real
all-to-alls of a tiny MoE GPT at EP = 2, each padded by ``T`` on the thread that runs it.

* :func:`padded_all_to_alls`: megatron's all-to-all token dispatcher (``MoEAlltoAllTokenDispatcher``) runs
  its expert-parallel all-to-alls in ``token_dispatch`` (tokens and probabilities) and ``token_combine``.
  While active, each of those calls lasts at least ``T`` from its start, and so does its backward (the
  reverse all-to-all autograd runs for it). The pad is a sleep where the collective runs: inline on the
  main thread when nothing overlaps; on CPU's communication-stream worker when megatron's combined step
  runs the dispatch and combine nodes (``integration/cpu_streams.py``), so the other micro-batch's compute
  runs on the main thread meanwhile: the overlap is measured, not modelled.
* :func:`padded_nodes`: with the overlap on, an op is a chain of megatron's schedule nodes, not one block;
  padding the op at its end would leave the all-to-alls nothing to run beside. Each compute node of a
  layer (``pre_dispatch_computation``: attention, router and permutation; ``mlp``: the experts) lasts at
  least its share of its op's compute, ``C / 2L`` (:mod:`~megatron_pp_ext.analysis.moe_comm`'s node model),
  counted from the moment its inputs are there. :class:`NodePads` holds the share of the op now running on
  each side (the padded tracer sets it at every op).

:func:`padded_all_to_alls` records ``(direction "F" | "B", "dispatch" | "combine", thread name)`` for every
padded all-to-all in the list it is given (the bench reports on which thread they ran; the tests read it).
Needs torch and megatron-core (rank processes only).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

from .emulate_a2a import sleep_until

__all__ = ["PADDED_NODES", "NodePads", "padded_all_to_alls", "padded_nodes"]

#: the compute nodes of a layer padded to a share of their op (megatron's node names)
PADDED_NODES = ("pre_dispatch_computation", "mlp")


Events = list[tuple[str, str, str]]


def _record(events: Events, direction: str, what: str) -> None:
    events.append((direction, what, threading.current_thread().name))  # list.append: safe across threads


def _pad_functions(a2a_s: float, events: Events) -> tuple[Any, Any]:
    """Two identity autograd functions for the backward pad: ``Start`` on the all-to-all's output notes
    when the backward reaches it, ``End`` on its input sleeps until ``a2a_s`` after that."""
    import torch

    class Start(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, clock: list[float]) -> torch.Tensor:
            ctx.clock = clock
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
            ctx.clock[0] = time.perf_counter()
            return grad, None

    class End(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, clock: list[float], what: str) -> torch.Tensor:
            ctx.clock, ctx.what = clock, what
            return x.view_as(x)

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
            sleep_until(ctx.clock[0] + a2a_s)
            _record(events, "B", ctx.what)
            return grad, None, None

    return Start, End


@contextlib.contextmanager
def padded_all_to_alls(a2a_s: float, events: Events) -> Iterator[None]:
    """While active, every dispatch and combine all-to-all of megatron's all-to-all dispatcher, forward and
    backward, lasts at least ``a2a_s`` seconds on the thread that runs it, noted in ``events`` (module doc)."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher as Dispatcher

    start, end = _pad_functions(a2a_s, events)
    dispatch, combine = Dispatcher.token_dispatch, Dispatcher.token_combine

    def padded(what: str, original: Any) -> Any:
        def call(self: Any, hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
            clock = [0.0]
            if hidden_states.requires_grad:
                hidden_states = end.apply(hidden_states, clock, what)
            started = time.perf_counter()
            out = original(self, hidden_states, *args, **kwargs)
            sleep_until(started + a2a_s)
            _record(events, "F", what)
            if isinstance(out, tuple):
                return (start.apply(out[0], clock), *out[1:]) if out[0].requires_grad else out
            return start.apply(out, clock) if out.requires_grad else out

        return call

    Dispatcher.token_dispatch = padded("dispatch", dispatch)  # type: ignore[method-assign]
    Dispatcher.token_combine = padded("combine", combine)  # type: ignore[method-assign]
    try:
        yield
    finally:
        Dispatcher.token_dispatch, Dispatcher.token_combine = dispatch, combine  # type: ignore[method-assign]


class NodePads:
    """Per side (``"F"``, ``"B"``) the seconds each padded compute node of the op now running lasts at least."""

    def __init__(self) -> None:
        self.current: dict[str, float] = {"F": 0.0, "B": 0.0}


@contextlib.contextmanager
def padded_nodes(pads: NodePads) -> Iterator[None]:
    """While active, megatron's schedule nodes named in :data:`PADDED_NODES` last at least
    ``pads.current[side]`` from when their inputs are there. Wraps whatever runs the nodes now (on CPU,
    the communication-stream shim, which must be installed first)."""
    from megatron.core.pipeline_parallel import utils

    from ..integration import cpu_streams

    node = utils.ScheduleNode
    forward, backward = node._forward, node._backward

    def padded(side: str, inner: Any) -> Any:
        def run(self: Any, *values: Any) -> Any:
            if self.name not in PADDED_NODES:
                return inner(self, *values)
            values = cpu_streams.resolved(values)
            started = time.perf_counter()
            out = inner(self, *values)
            sleep_until(started + pads.current[side])
            return out

        run._megatron_pp_cpu = True  # type: ignore[attr-defined]  # the shim's mark: installed, keep
        return run

    node._forward = padded("F", forward)  # type: ignore[method-assign]
    node._backward = padded("B", backward)  # type: ignore[method-assign]
    try:
        yield
    finally:
        node._forward, node._backward = forward, backward  # type: ignore[method-assign]
