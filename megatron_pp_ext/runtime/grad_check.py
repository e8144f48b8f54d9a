"""Runtime guard: every trainable parameter got its gradient for every micro-batch (``--pipeline-check-grads``).

The executor watches the backward ops (B, W, BW) of the first training iteration of the process, and of
every training iteration with ``--pipeline-check-grads``. Around each op of ``(chunk, micro-batch)`` it
fingerprints the gradient accumulator of every trainable parameter of the chunk (``main_grad`` under
megatron DDP, else ``.grad``): a parameter *received* its gradient for that micro-batch when its
accumulator changed during one of the micro-batch's backward ops on the chunk. At the end of the
iteration, after the weight-gradient store was checked empty, every parameter must have received one for
every micro-batch that ran a backward through its chunk, and every Transformer Engine layer's own queue
must be empty; otherwise :class:`GradCheckError` names the parameters, chunks and micro-batches.

This catches a W that computes nothing (a layer whose deferred GEMMs are never run, TE's config-gated
``backward_dw``, a provider that finds no layer) whatever the mechanism. Cost: two reductions per
parameter before and after each backward op, in watched iterations only; nothing in the others (the
executor gets no watcher). A parameter whose true gradient for a micro-batch is exactly zero (e.g. an
MoE expert that received no token) is reported too: leave such runs unwatched past the first iteration.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

MAX_LISTED = 8


class GradCheckError(RuntimeError):
    """A parameter missed its gradient for a micro-batch, or a weight-gradient queue was left non-empty."""


def _accumulator(param: torch.nn.Parameter) -> torch.Tensor | None:
    main_grad = getattr(param, "main_grad", None)
    return main_grad if main_grad is not None else param.grad


class GradWatch:
    """Watches one training iteration of one rank's model chunks."""

    def __init__(self, models: Sequence[torch.nn.Module]) -> None:
        self.models = list(models)
        from .mtp import unused_parameters

        self.params = []
        for model in self.models:
            unused = unused_parameters(model)  # megatron's forward never reads them: no gradient is right
            self.params.append([(n, p) for n, p in model.named_parameters() if p.requires_grad and id(p) not in unused])
        self.received: list[list[set[int]]] = [[set() for _ in ps] for ps in self.params]
        self.ran: list[set[int]] = [set() for _ in self.models]

    def _fingerprint(self, chunk: int) -> torch.Tensor:
        rows = []
        for _, p in self.params[chunk]:
            acc = _accumulator(p)
            if acc is None or acc.untyped_storage().nbytes() == 0:  # none yet (or a freed FSDP buffer)
                rows.append(torch.zeros(2, dtype=torch.float64, device=p.device))
            else:
                acc = acc.detach()
                rows.append(torch.stack([acc.sum(dtype=torch.float64), acc.abs().sum(dtype=torch.float64)]))
        if not rows:
            return torch.zeros(0, 2, dtype=torch.float64)
        return torch.stack(rows)

    @contextlib.contextmanager
    def watch(self, chunk: int, microbatch: int) -> Iterator[None]:
        """Around one backward op (B, W or BW) of ``(chunk, microbatch)``."""
        before = self._fingerprint(chunk)
        yield
        after = self._fingerprint(chunk)
        self.ran[chunk].add(microbatch)
        changed = (before != after).any(dim=1).tolist() if len(before) else []
        for index, moved in enumerate(changed):
            if moved:
                self.received[chunk][index].add(microbatch)

    def problems(self) -> list[str]:
        """What went wrong, one entry per parameter or layer; empty when every gradient arrived."""
        from .te_wgrad import pending_te_entries

        found = []
        for chunk, params in enumerate(self.params):
            for index, (name, _) in enumerate(params):
                missing = sorted(self.ran[chunk] - self.received[chunk][index])
                if missing:
                    found.append(f"{name} (chunk {chunk}): no gradient for micro-batch(es) {missing}")
            for module, entries in pending_te_entries(self.models[chunk]):
                found.append(f"{module} (chunk {chunk}): {entries} Transformer Engine weight-gradient entries left")
        return found

    def finish(self, where: str) -> None:
        found = self.problems()
        if found:
            shown = "; ".join(found[:MAX_LISTED])
            more = f"; and {len(found) - MAX_LISTED} more" if len(found) > MAX_LISTED else ""
            raise GradCheckError(
                f"{where}: weight gradients missing after the iteration ({len(found)} problem(s)): {shown}{more}. "
                "The B/W split dropped them: run an unsplit schedule (e.g. 1f1b) or --transformer-impl local "
                "and report this"
            )


class GradCheckPolicy:
    """Which iterations get a :class:`GradWatch`: the first training one, and all with ``every_iteration``."""

    def __init__(self, every_iteration: bool = False) -> None:
        self.every_iteration = every_iteration
        self.watched = 0

    def watcher(self, models: Sequence[torch.nn.Module], forward_only: bool) -> GradWatch | None:
        if forward_only or (self.watched and not self.every_iteration):
            return None
        self.watched += 1
        return GradWatch(models)


def watching(watch: GradWatch | None, chunk: int, microbatch: int) -> Any:
    """``watch.watch(chunk, microbatch)``, or a no-op context when the iteration is not watched."""
    return contextlib.nullcontext() if watch is None else watch.watch(chunk, microbatch)
