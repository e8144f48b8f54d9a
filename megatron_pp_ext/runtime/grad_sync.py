"""Megatron's data-parallel gradient hooks (``no_sync``, ``grad_sync_func``) driven by the schedule.

The executor keeps gradient reduction off for the whole iteration and launches each chunk's reduction
where the collectives pass places it (:mod:`megatron_pp_ext.schedules.collectives`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .errors import ExecutorError


class GradSync:
    """Megatron's no_sync / grad_sync hooks, driven by the schedule.

    Grad reduction stays disabled (``no_sync``) for the whole iteration. The derived
    ``reduce-grads`` collective of a chunk, right after the chunk's last gradient-producing op,
    launches megatron's ``grad_sync_func`` (set by megatron's training loop with
    ``overlap_grad_reduce`` and ``align_grad_reduce``), or the chunk's own ``start_grad_sync``
    when its DDP overlaps the reduction without that hook. Without an overlapped reduction
    megatron's ``finalize_model_grads`` reduces everything after the pipeline, as in megatron.
    """

    def __init__(
        self, config: Any, models: Sequence[torch.nn.Module], active: bool, expected: dict[int, int] | None = None
    ) -> None:
        self.models = models
        self.expected = expected or {}  # chunk -> reductions the collectives pass placed (several: per unit)
        self.active = active
        no_sync = config.no_sync_func if active else None
        if isinstance(no_sync, list):
            funcs = list(no_sync)

            @contextlib.contextmanager
            def all_no_sync() -> Iterator[None]:
                with contextlib.ExitStack() as stack:
                    for f in funcs:
                        stack.enter_context(f())
                    yield

            no_sync = all_no_sync
        self.no_sync_func = no_sync or contextlib.nullcontext
        self.grad_sync_func = grad_sync_funcs(config, models) if active else None
        self.synced: dict[int, int] = {}  # chunk -> reductions launched this iteration
        self._ctx: Any = None

    def disable(self) -> None:
        if self._ctx is None:
            self._ctx = self.no_sync_func()
            self._ctx.__enter__()

    def enable(self) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None

    def reduce(self, chunk: int) -> None:
        """The derived ``reduce-grads`` collective: start the chunk's data-parallel reduction."""
        assert self.grad_sync_func is not None
        launched = self.synced.get(chunk, 0) + 1
        if launched > self.expected.get(chunk, 1):
            raise ExecutorError(
                f"gradient reduction of chunk {chunk} launched {launched} times in one iteration, the collectives "
                f"pass placed {self.expected.get(chunk, 1)}"
            )
        self.grad_sync_func[chunk](self.models[chunk].parameters())
        self.synced[chunk] = launched

    def finish(self, where: str) -> None:
        self.enable()
        if self.grad_sync_func is not None:
            missing = [chunk for chunk in range(len(self.models)) if chunk not in self.synced]
            if missing:
                raise ExecutorError(f"{where}: chunks {missing} never launched their gradient reduction")
            short = {c: (self.synced[c], n) for c, n in self.expected.items() if self.synced.get(c, 0) < n}
            if short:
                raise ExecutorError(f"{where}: chunk -> (reductions launched, placed): {short}")


def grad_sync_funcs(config: Any, models: Sequence[torch.nn.Module]) -> list[Callable[..., Any]] | None:
    """Per chunk, what starts its overlapped gradient reduction: megatron's ``grad_sync_func``, else a
    DDP chunk's ``start_grad_sync`` when its ``overlap_grad_reduce`` is on, else None (no overlap)."""
    funcs = per_chunk(config.grad_sync_func, len(models))
    if funcs is not None:
        return funcs
    overlapped = [getattr(getattr(m, "ddp_config", None), "overlap_grad_reduce", False) for m in models]
    if models and all(overlapped):
        return [lambda params, m=m: m.start_grad_sync() for m in models]
    return None


def per_chunk(funcs: Any, num_chunks: int) -> list[Callable[..., Any]] | None:
    """Megatron's per-chunk hook lists (``grad_sync_func``, ``param_sync_func``): one function or a list."""
    if funcs is None:
        return None
    return list(funcs) if isinstance(funcs, list) else [funcs] * num_chunks
