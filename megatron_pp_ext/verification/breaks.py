"""Deliberate faults for testing the verdict (:mod:`.criterion`): each makes a run silently wrong.

A verification criterion is only as good as the faults it catches. Each break here is a way a
pipeline runtime can go wrong without raising: it is injected into the run under test (``RunHooks.breaks``)
inside the rank process and undone afterwards (rank-pool workers run other specs later). The tests in
``tests/verification/test_verify_breaks.py`` run each one and check the verdict fails, printing by how much.

* ``w-skipped``: the first W of chunk 0 drops its weight-gradient closures (micro-batch 0's weight
  gradients are never added; the runtime's own guard, ``runtime/grad_check.py``, is switched off);
* ``w-twice``: the first W of chunk 0 runs its closures twice (micro-batch 0's weight gradients added twice);
* ``microbatch-swapped``: the chunk holding the loss pairs micro-batch 0's activations with micro-batch
  1's labels (a loss computed on another micro-batch's data);
* ``dp-reduction-missing``: megatron DDP's gradient reduction does no communication (each replica keeps
  its own gradients);
* ``dp-reduction-early``: each chunk's derived data-parallel reduction launched after its first backward
  instead of its last (later micro-batches' gradients miss the reduction);
* ``fsdp-stale-shards``: FSDP gathers each chunk's first shard again in every iteration (the optimizer's
  updates never reach the gathered parameters);
* ``moe-aux-loss-twice``: MoE models: the router's load-balancing loss gets twice the scale megatron's
  ``forward_step`` sets per micro-batch (an auxiliary loss counted twice).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

BREAKS = (
    "w-skipped",
    "w-twice",
    "microbatch-swapped",
    "dp-reduction-missing",
    "dp-reduction-early",
    "fsdp-stale-shards",
    "moe-aux-loss-twice",
)


@contextlib.contextmanager
def injected(names: tuple[str, ...]) -> Iterator[None]:
    """Apply the named breaks for the duration of the block."""
    unknown = sorted(set(names) - set(BREAKS))
    if unknown:
        raise ValueError(f"unknown break(s) {unknown}; known: {', '.join(BREAKS)}")
    with contextlib.ExitStack() as stack:
        for name in names:
            stack.enter_context(_APPLY[name]())
        yield


@contextlib.contextmanager
def _patched(owner: Any, attr: str, make: Callable[[Any], Any]) -> Iterator[None]:
    original = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
    setattr(owner, attr, make(original))
    try:
        yield
    finally:
        setattr(owner, attr, original)


def _first_w(times: int) -> contextlib.AbstractContextManager[None]:
    from ..runtime.wgrad import WeightGradStore

    done: set[tuple[int, int]] = set()

    def make(original: Any) -> Any:
        def run(self: WeightGradStore, chunk: int, microbatch: int, where: str) -> None:
            if chunk != 0 or done:
                return original(self, chunk, microbatch, where)
            done.add((chunk, microbatch))
            closures = self._queues.pop((chunk, microbatch))
            self._held_bytes.pop((chunk, microbatch), None)
            for _ in range(times):
                for closure in closures:
                    closure()

        return run

    return _patched(WeightGradStore, "run", make)


@contextlib.contextmanager
def _w_skipped() -> Iterator[None]:
    from ..runtime.grad_check import GradWatch

    # The runtime's weight-gradient guard names a W that added nothing; switched off here so that what
    # is tested is the verdict on the numbers.
    with _first_w(0), _patched(GradWatch, "finish", lambda original: lambda self, where: None):
        yield


def _w_twice() -> contextlib.AbstractContextManager[None]:
    return _first_w(2)


def _microbatch_swapped() -> contextlib.AbstractContextManager[None]:
    from ..runtime.data import MicrobatchIterator
    from . import tiny_gpt

    def make(original: Any) -> Any:
        def forward_step(data_iterator: Any, model: Any) -> Any:
            gpt = tiny_gpt._unwrap(model)
            if gpt.post_process and isinstance(data_iterator, MicrobatchIterator) and data_iterator.current == 0:
                while data_iterator._read <= 1:  # read micro-batch 1's sample ahead (it stays pending)
                    data_iterator._pending[data_iterator._read] = next(data_iterator._inner)
                    data_iterator._read += 1
                labels = data_iterator._pending[1]["labels"]
                sample = data_iterator._pending[0]
                data_iterator._pending[0] = {**sample, "labels": labels}
            return original(data_iterator, model)

        return forward_step

    return _patched(tiny_gpt, "forward_step", make)


def _dp_reduction_missing() -> contextlib.AbstractContextManager[None]:
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

    class _Done:
        def wait(self) -> None:
            return None

    def make(original: Any) -> Any:
        def start_grad_sync(self: Any, force_all_reduce: bool | None = False) -> None:
            self.grad_reduce_handle = _Done()

        return start_grad_sync

    return _patched(_ParamAndGradBucketGroup, "start_grad_sync", make)


def _dp_reduction_early() -> contextlib.AbstractContextManager[None]:
    from ..runtime import run_plan
    from ..schedules.collectives import CollectiveKind
    from ..schedules.ir import OpKind
    from ..schedules.lowering import Compute

    def make(original: Any) -> Any:
        def plan_for(lowered: Any, *args: Any, **kwargs: Any) -> Any:
            plan = original(lowered, *args, **kwargs)
            placement = lowered.schedule.placement
            first_backward: dict[int, int] = {}  # chunk -> gap after its first backward
            gap = 0
            for ins in plan.program:
                if isinstance(ins, Compute):
                    gap += 1
                    if ins.op.kind in (OpKind.B, OpKind.BW):
                        first_backward.setdefault(placement.chunk_of(ins.op.stage), gap)
            moved: dict[int, list[Any]] = {}
            for at, items in plan.collectives.items():
                for c in items:
                    if c.kind == CollectiveKind.REDUCE_GRADS:
                        at = first_backward.get(placement.chunk_of(c.stage), at)
                    moved.setdefault(at, []).append(c)
            plan.collectives.clear()
            plan.collectives.update({k: tuple(v) for k, v in moved.items()})
            return plan

        return plan_for

    return _patched(run_plan, "plan_for", make)


def _fsdp_stale_shards() -> contextlib.AbstractContextManager[None]:
    from ..runtime.fsdp import ShardedChunk

    def make(original: Any) -> Any:
        def unshard(self: Any, async_op: bool = False) -> None:
            first = self.__dict__.setdefault("_first_shard", self.main_shard.detach().clone())
            current = self.main_shard.data
            self.main_shard.data = first
            try:
                original(self, async_op=async_op)
            finally:
                self.main_shard.data = current

        return unshard

    return _patched(ShardedChunk, "unshard", make)


def _moe_aux_loss_twice() -> contextlib.AbstractContextManager[None]:
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    def make(original: Any) -> Any:
        return staticmethod(lambda scale: original.__func__(scale * 2))

    return _patched(MoEAuxLossAutoScaler, "set_loss_scale", make)


_APPLY: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "w-skipped": _w_skipped,
    "w-twice": _w_twice,
    "microbatch-swapped": _microbatch_swapped,
    "dp-reduction-missing": _dp_reduction_missing,
    "dp-reduction-early": _dp_reduction_early,
    "fsdp-stale-shards": _fsdp_stale_shards,
    "moe-aux-loss-twice": _moe_aux_loss_twice,
}
