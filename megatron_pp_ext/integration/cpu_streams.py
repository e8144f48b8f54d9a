"""CPU mode: megatron's communication stream as one worker thread, so combined-step all-to-alls overlap.

megatron's combined forward-backward step (``--overlap-moe-expert-parallel-comm``) runs a forward and
a backward node by node; the token dispatch and combine nodes of both sides run on a communication
stream (``pipeline_parallel.utils.get_comm_stream``), the others on the compute stream, and a node of
one micro-batch waits for the previous node of the same micro-batch (its event). On a GPU the
all-to-all of a dispatch or combine node thus runs while the host goes on to the other micro-batch's
compute nodes. CPU mode has no streams (``cpu.py`` makes them null objects), so every node would run
to its end before the next starts.

:func:`patch_schedule_nodes` gives the communication stream a meaning on CPU: a node whose stream is
the communication stream runs on one worker thread (nodes in the order they were issued, as on a
stream), and the host gets a pending value back at once. The next node that takes that value waits
for it first, which is what the event of its micro-batch does on a GPU; the host, meanwhile, runs
the other micro-batch's compute nodes. The node's code is megatron's, unchanged (gloo's all-to-all,
the token (un)permutation of the combine, its bias-dropout-add); only the thread differs, so losses
and gradients are the same bits. The worker thread enters CPU mode's device rewriting (a per-thread
torch function mode) like the main thread. Every rank of an expert-parallel group issues the same
nodes in the same order, so their collectives meet in order on the one worker.

One change of order on the host, not on the streams: the forward's token dispatch is issued right after
its attention node instead of after the backward's expert nodes (:func:`_layer_step` says why).

``EVENTS`` (None, or a list the tests set) records ``("launch" | "wait" | "compute", node name,
"F" | "B", serial)`` in the host's order: a communication node issued, its result waited for (the
serial number pairs the two), a compute node run (serial -1).

Every wait is bounded by ``MEGATRON_PP_P2P_TIMEOUT`` (the executor's bound for a pipeline message): a
node that fails (a dead expert-parallel peer closes gloo's connection) or does not finish in time
raises :class:`CommStreamError` naming the node; the executor adds the rank and the op.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from ..runtime.errors import CommStreamError

__all__ = ["EVENTS", "CommStreamError", "patch_schedule_nodes", "resolve", "resolved"]

EVENTS: list[tuple[str, str, str, int]] | None = None

_LOCK = threading.Lock()
_SERIAL = [0]
_WORKER: _Worker | None = None


class _Worker:
    """One daemon thread running submitted calls in order (a stream). A daemon, so that a call stuck
    in a collective with a dead peer cannot keep the process from exiting once the error is reported."""

    def __init__(self, thread_setup: Callable[[], Any]) -> None:
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(
            target=self._loop, args=(thread_setup,), name="megatron-pp-comm-stream", daemon=True
        )
        self.thread.start()

    def _loop(self, thread_setup: Callable[[], Any]) -> None:
        thread_setup()
        while True:
            future, fn, args = self.calls.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as exc:  # handed to the waiting host thread
                    future.set_exception(exc)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        future: Future = Future()
        self.calls.put((future, fn, args))
        return future


class _PendingComm:
    """A communication node's output, still being computed on the worker thread."""

    __slots__ = ("future", "name", "serial", "side")

    def __init__(self, future: Future, name: str, side: str, serial: int) -> None:
        self.future, self.name, self.side, self.serial = future, name, side, serial

    def result(self) -> Any:
        from ..runtime.p2p import timeout_from_env

        what = f"{self.name} ({'forward' if self.side == 'F' else 'backward'}) on megatron's communication stream"
        timeout_s = timeout_from_env()
        try:
            value = self.future.result(timeout=timeout_s)
        except FutureTimeout:
            raise CommStreamError(
                f"{what} did not finish within {timeout_s:g} s (MEGATRON_PP_P2P_TIMEOUT): an expert-parallel "
                "peer is dead or stuck in another collective"
            ) from None
        except Exception as exc:
            raise CommStreamError(f"{what} failed: {type(exc).__name__}: {exc}") from exc
        if EVENTS is not None and self.serial:
            EVENTS.append(("wait", self.name, self.side, self.serial))
        return value


def _worker(thread_setup: Callable[[], Any]) -> _Worker:
    global _WORKER
    with _LOCK:
        if _WORKER is None:
            _WORKER = _Worker(thread_setup)
        return _WORKER


def resolved(values: tuple) -> tuple:
    """``values`` with pending outputs waited for; one pending tuple stands for the values it holds
    (megatron's node ``forward`` / ``backward`` wrap a single non-tuple argument in a tuple)."""
    if len(values) == 1 and isinstance(values[0], _PendingComm):
        value = values[0].result()
        return value if isinstance(value, tuple) else (value,)
    return tuple(v.result() if isinstance(v, _PendingComm) else v for v in values)


def resolve(value: Any) -> Any:
    """``value``, waited for if it is a pending communication output."""
    return value.result() if isinstance(value, _PendingComm) else value


def _resolving_first(callback: Callable[..., Any]) -> Callable[..., Any]:
    def call(value: Any, *args: Any) -> Any:
        return callback(resolve(value), *args)

    return call


def patch_schedule_nodes(thread_setup: Any) -> None:
    """Run megatron's communication-stream schedule nodes on the worker thread (idempotent);
    ``thread_setup()`` runs once on that thread (CPU mode's device rewriting)."""
    from megatron.core.models.common import model_chunk_schedule_plan as plans
    from megatron.core.pipeline_parallel import utils

    node = utils.ScheduleNode
    if getattr(node._forward, "_megatron_pp_cpu", False):
        return
    originals = {"F": node._forward, "B": node._backward}

    def step(side: str) -> Any:
        original = originals[side]

        def run(self: Any, *values: Any) -> Any:
            values = resolved(values)
            stream = self.stream() if callable(self.stream) else self.stream
            if stream is None or stream is not utils.get_comm_stream():
                if EVENTS is not None:
                    EVENTS.append(("compute", self.name, side, -1))
                return original(self, *values)
            _SERIAL[0] += 1
            if EVENTS is not None:
                EVENTS.append(("launch", self.name, side, _SERIAL[0]))
            return _PendingComm(_worker(thread_setup).submit(original, self, *values), self.name, side, _SERIAL[0])

        run._megatron_pp_cpu = True  # type: ignore[attr-defined]
        return run

    node._forward = step("F")
    node._backward = step("B")

    chunk_plan = plans.TransformerModelChunkSchedulePlan
    run_chunks = chunk_plan.run

    def run_plans(*args: Any, **kwargs: Any) -> Any:
        """megatron's chunk-level combined run; its result (the last forward node's output) waited for,
        and every node issued to the worker finished, before the step goes on; its pipeline callbacks
        (megatron's interleaved schedule sends and receives there) get waited-for values too."""
        for hook in ("post_forward", "post_backward"):  # megatron's p2p callbacks take the last node's output
            if kwargs.get(hook) is not None:
                kwargs[hook] = _resolving_first(kwargs[hook])
        output = resolve(run_chunks(*args, **kwargs))
        _PendingComm(_worker(thread_setup).submit(lambda: None), "end of the step", "F", 0).result()
        return output

    chunk_plan.run = staticmethod(run_plans)
    plans.TransformerLayerSchedulePlan.run = staticmethod(_layer_step)


def _layer_step(
    f_layer: Any, b_layer: Any, f_input: Any = None, b_grad: Any = None, is_last_layer_in_bwd: bool = False
) -> tuple[Any, Any]:
    """One layer of a forward (``f_layer``) beside one layer of a backward (``b_layer``), either may be
    None: megatron's nodes, issued in megatron's order on each stream, but on the host each
    communication node as soon as its input exists.

    On a GPU, megatron issues the forward's dispatch after the backward's expert nodes, which are then
    still running on the compute stream, so the dispatch travels beside them. On CPU a compute node is
    finished when the host issues the next node: issuing the forward's dispatch right after its own
    attention node (before the backward's expert nodes) restores what the GPU overlaps. The
    communication stream sees the same sequence as megatron's (combine-B, dispatch-F, dispatch-B,
    combine-F), every node the same inputs, so the numbers are megatron's.
    """
    from contextlib import nullcontext

    low = f_layer.get_low_precision_context if f_layer is not None else nullcontext
    early_release = b_layer is not None and b_layer.config.ep_overlap_early_attn_memory_release
    if b_layer is not None:
        b_grad = b_layer.moe_combine.backward(b_layer.mtp_post_process.backward(b_grad))
    if f_layer is not None:
        with low():
            f_input = f_layer.pre_dispatch_computation.forward(f_input)
        with low():
            f_input = f_layer.moe_dispatch.forward(f_input)
    if b_layer is not None:
        b_grad = b_layer.mlp.backward(b_grad)
        b_layer.mlp.backward_dw()
        b_grad = b_layer.moe_dispatch.backward(b_grad)
        if early_release:
            b_grad = b_layer.pre_dispatch_computation.backward(b_grad)
    if f_layer is not None:
        with low():
            f_input = f_layer.mlp.forward(f_input)
        with low():
            f_input = f_layer.moe_combine.forward(f_input)
    if b_layer is not None and not early_release:
        b_grad = b_layer.pre_dispatch_computation.backward(b_grad)
    if f_layer is not None:
        with low():
            f_input = f_layer.mtp_post_process.forward(f_input)
    if b_layer is not None and not is_last_layer_in_bwd:
        b_layer.pre_dispatch_computation.backward_dw()
    return f_input, b_grad
