"""Megatron's forward-backward function and ours timed on the same ranks, model and data (``RunSpec``
mode ``AB``), and the run modes of a verification spec."""

from __future__ import annotations

import time
from typing import Any

from .saved_bytes import SavedBytesMeter

NATIVE = "native"  # megatron-core's own forward_backward_func
OURS = "ours"  # megatron_pp_ext's executor
AB = "ab"  # timing: each iteration runs megatron's function and ours, in alternating order


def ab_timing(spec: Any, chunks: list[Any], ours: Any, native: Any) -> dict[str, Any]:
    """Time megatron's function and ours on the same ranks, model and data, alternating which goes first;
    then one more iteration of each under :class:`SavedBytesMeter` (peak bytes autograd holds for backward)."""
    from . import tiny_gpt

    multi = len(chunks) > 1  # megatron's interleaved schedule takes the chunk and iterator lists, like ours

    def step(name: str, func: Any, iteration: int) -> list[float]:
        for c in chunks:
            c.zero_grad_buffer()
        batches = tiny_gpt.make_batches(spec.model, iteration, spec.num_microbatches)
        out = func(
            forward_step_func=tiny_gpt.forward_step,
            data_iterator=[iter(batches) for _ in chunks] if multi else iter(batches),
            model=chunks if name == OURS or multi else chunks[0],
            num_microbatches=spec.num_microbatches,
            seq_length=spec.model.seq_length,
            micro_batch_size=spec.model.micro_batch_size,
            decoder_seq_length=spec.model.seq_length,
        )
        return [float(d["lm loss"]) for d in out]

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
