"""FSDP's full-size buffers per rank, from the lowering alone: the memory model of gathered parameters and
unreduced gradients that :class:`megatron_pp_ext.runtime.fsdp.ShardedChunk` measures.

Walking a rank's ops and the collectives :func:`~megatron_pp_ext.schedules.collectives.derive_collectives`
placed between them:

* a chunk's full **parameters** are held from its ``unshard`` to its ``reshard``;
* a chunk's full **gradient** buffer is held from its first gradient-producing op (``B``, ``W``, ``BW``) after
  the previous reduction (or the iteration's start) up to its next ``reduce-grads``. The runtime frees it once
  the reduce-scatter has completed, so its live set at any moment contains this one: the measured peak is at
  least the model's, and equals it when the model's peak already holds every chunk.

Peaks are in bytes given one number per global stage (a chunk's full parameter bytes; its fp32 gradient
buffer is given separately, as the runtime keeps gradients in fp32 whatever the parameters' dtype).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..schedules.collectives import CollectiveKind, CollectivePlan
from ..schedules.ir import OpKind

__all__ = ["FsdpBufferPeaks", "fsdp_buffer_peaks"]

_MAKES_GRADS = (OpKind.B, OpKind.W, OpKind.BW)


@dataclass(frozen=True)
class FsdpBufferPeaks:
    """Per rank: peak bytes of gathered parameters, of live full gradients, and of both together; and the
    mean live gradient bytes over the rank's ops (each op weighs the same: a count, not a time)."""

    params: tuple[float, ...]
    grads: tuple[float, ...]
    total: tuple[float, ...]
    mean_grads: tuple[float, ...]


def fsdp_buffer_peaks(
    plan: CollectivePlan, param_bytes: Sequence[float], grad_bytes: Sequence[float] | None = None
) -> FsdpBufferPeaks:
    """Peaks of FSDP's full buffers on every rank of ``plan`` (module doc). ``param_bytes`` / ``grad_bytes``:
    one chunk's full parameter / gradient bytes per global stage (gradients default to the parameters')."""
    schedule = plan.schedule
    if len(param_bytes) != schedule.num_stages:
        raise ValueError(f"param_bytes: one number per stage ({schedule.num_stages}), got {len(param_bytes)}")
    grad_bytes = param_bytes if grad_bytes is None else grad_bytes
    if len(grad_bytes) != schedule.num_stages:
        raise ValueError(f"grad_bytes: one number per stage ({schedule.num_stages}), got {len(grad_bytes)}")
    params, grads, total, mean = [], [], [], []
    for rank, ops in enumerate(schedule.ops):
        by_gap = plan.on_rank(rank)
        gathered: set[int] = set()
        live: set[int] = set()
        peak_p = peak_g = peak_t = 0.0
        area = 0.0
        for i in range(len(ops) + 1):
            for c in by_gap.get(i, ()):
                if c.kind == CollectiveKind.UNSHARD:
                    gathered.add(c.stage)
                elif c.kind == CollectiveKind.RESHARD:
                    gathered.discard(c.stage)
                elif c.kind == CollectiveKind.REDUCE_GRADS:
                    live.discard(c.stage)
            if i == len(ops):
                break
            if ops[i].kind in _MAKES_GRADS:
                live.add(ops[i].stage)
            p, g = sum(param_bytes[s] for s in gathered), sum(grad_bytes[s] for s in live)
            peak_p, peak_g, peak_t = max(peak_p, p), max(peak_g, g), max(peak_t, p + g)
            area += g
        params.append(peak_p)
        grads.append(peak_g)
        total.append(peak_t)
        mean.append(area / len(ops) if ops else 0.0)
    return FsdpBufferPeaks(tuple(params), tuple(grads), tuple(total), tuple(mean))
