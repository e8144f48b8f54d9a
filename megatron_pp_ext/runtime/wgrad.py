"""Weight-gradient store: B computes input gradients now, W computes weight gradients later.

While a ``B`` op runs with deferral enabled, every linear layer hooked by
:mod:`megatron_pp_ext.runtime.wgrad_hooks` computes its input gradient at once and
queues a closure for its weight (and bias) gradient, tagged ``(chunk, micro-batch)``.
A ``W`` op runs exactly the closures of its ``(chunk, micro-batch)``. The queue must
be empty at the end of every iteration.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any, Protocol


class WeightGradError(RuntimeError):
    """The B/W split was used inconsistently (missing W, W without B, no hooks)."""


WGradClosure = Callable[[], None]


class DeferralProvider(Protocol):
    """Something besides megatron's linears that defers weight gradients (e.g. Transformer Engine).

    Its layers defer whatever the op, so the store calls it around every backward of a chunk it applies
    to: ``before_backward`` first, then ``after_input_grad`` after a B (queue the W work in the store) or
    ``after_full_backward`` after a BW (do the W work at once).
    """

    def applies_to(self, model_chunk: Any) -> bool: ...

    def before_backward(self, chunk: int, microbatch: int, model_chunk: Any) -> None: ...

    def after_full_backward(self, chunk: int, microbatch: int, model_chunk: Any) -> None: ...

    def after_input_grad(self, chunk: int, microbatch: int, model_chunk: Any, store: WeightGradStore) -> None: ...


class WeightGradStore:
    def __init__(self) -> None:
        self._queues: dict[tuple[int, int], list[WGradClosure]] = defaultdict(list)
        self._held_bytes: dict[tuple[int, int], int] = defaultdict(int)
        self._active: tuple[int, int] | None = None
        self.hooks_installed = False
        self.on_held_bytes: Callable[[int], None] | None = None
        self.providers: list[DeferralProvider] = []

    # ---- used by the hooked layers ---------------------------------------------------------
    @property
    def deferring_now(self) -> bool:
        return self._active is not None

    def put(self, closure: WGradClosure, held_bytes: int = 0) -> None:
        assert self._active is not None
        self._queues[self._active].append(closure)
        self._held_bytes[self._active] += held_bytes
        if self.on_held_bytes is not None and held_bytes:
            self.on_held_bytes(held_bytes)

    # ---- used by the executor --------------------------------------------------------------
    @contextlib.contextmanager
    def deferring(
        self, chunk: int, microbatch: int, *, enabled: bool, where: object, model_chunk: Any = None
    ) -> Iterator[None]:
        """Run a B op: linear layers queue their weight gradients under ``(chunk, microbatch)``.

        ``enabled=False`` (a BW op): a plain backward, after which providers whose layers defer anyway
        compute their weight gradients at once.
        """
        providers = [p for p in self.providers if model_chunk is not None and p.applies_to(model_chunk)]
        for provider in providers:
            provider.before_backward(chunk, microbatch, model_chunk)
        if not enabled:
            yield
            for provider in providers:
                provider.after_full_backward(chunk, microbatch, model_chunk)
            return
        if not self.hooks_installed and not providers:
            raise WeightGradError(
                f"{where}: this schedule splits the backward into B and W, but the weight-gradient hooks "
                "are not installed (call megatron_pp_ext.runtime.wgrad_hooks.install_wgrad_hooks() before "
                "building the model)"
            )
        self._active = (chunk, microbatch)
        self._queues.setdefault(self._active, [])
        try:
            yield
            for provider in providers:
                provider.after_input_grad(chunk, microbatch, model_chunk, self)
        finally:
            self._active = None

    def run(self, chunk: int, microbatch: int, where: object) -> None:
        key = (chunk, microbatch)
        if key not in self._queues:
            raise WeightGradError(f"{where}: W for chunk {chunk} micro-batch {microbatch} has no deferred B")
        for closure in self._queues.pop(key):
            closure()
        held = self._held_bytes.pop(key, 0)
        if self.on_held_bytes is not None and held:
            self.on_held_bytes(-held)

    def queued(self, chunk: int, microbatch: int) -> int:
        """Closures waiting for the W of ``(chunk, microbatch)``."""
        return len(self._queues.get((chunk, microbatch), ()))

    def pending(self) -> list[tuple[int, int]]:
        return sorted(self._queues)

    def check_empty(self, where: str) -> None:
        if self._queues:
            keys = ", ".join(f"chunk {c} micro-batch {m}" for c, m in self.pending())
            self._queues.clear()
            self._held_bytes.clear()
            raise WeightGradError(f"{where}: weight gradients never computed (no W op) for {keys}")


_STORE = WeightGradStore()


def get_weight_grad_store() -> WeightGradStore:
    return _STORE
