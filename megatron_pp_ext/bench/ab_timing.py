"""Megatron's forward-backward function and ours timed on the same ranks, model and data (``RunSpec``
mode ``AB``)."""

from __future__ import annotations

import time
from typing import Any

from ..verification.run_spec import NATIVE, OURS
from ..verification.saved_bytes import SavedBytesMeter


def ab_timing(spec: Any, chunks: list[Any], ours: Any, native: Any) -> dict[str, Any]:
    """Time megatron's function and ours on the same ranks, model and data, alternating which goes first;
    then one more iteration of each under :class:`SavedBytesMeter` (peak bytes autograd holds for backward)."""
    from ..verification import tiny_gpt

    def step(name: str, func: Any, iteration: int) -> list[float]:
        for c in chunks:
            c.zero_grad_buffer()
        batches = tiny_gpt.make_batches(spec.model, iteration, spec.num_microbatches)
        return tiny_gpt.run_forward_backward(func, spec.model, chunks, batches, chunk_list=name == OURS)

    times: dict[str, list[float]] = {NATIVE: [], OURS: []}
    losses: dict[str, list[list[float]]] = {NATIVE: [], OURS: []}
    for iteration in range(spec.iterations):
        order = [(NATIVE, native), (OURS, ours)]
        if iteration % 2:
            order.reverse()
        for name, func in order:
            started = time.perf_counter()
            losses[name].append(step(name, func, iteration))
            times[name].append(time.perf_counter() - started)
    params = {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()}
    peak: dict[str, int] = {}
    for name, func in ((NATIVE, native), (OURS, ours)):
        meter = SavedBytesMeter(params)
        with meter:
            step(name, func, spec.iterations)
        peak[name] = meter.peak
    return {"step_times": times, "losses": losses, "peak_saved_bytes": peak}
