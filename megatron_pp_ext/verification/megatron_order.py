"""Whether a schedule is megatron-core's own interleaved 1F1B order, and with which micro-batch group size.

A schedule travels to the ranks as CSV, without its generator's parameters; megatron's interleaved
schedule needs the group size (``microbatch_group_size_per_vp_stage``) to run the same order, so it is
found again from the ops.
"""

from __future__ import annotations

from typing import Any

__all__ = ["is_megatron_interleaved", "megatron_interleaved_group"]


def megatron_interleaved_group(schedule: Any) -> int | None:
    """The micro-batch group size with which megatron-core's interleaved 1F1B runs exactly ``schedule``'s ops
    on its placement, or None when no group size does (another schedule, or one chunk per rank)."""
    from ..schedules import generate

    p, m, v = schedule.num_ranks, schedule.num_microbatches, schedule.chunks_per_rank
    if v < 2:
        return None
    ops = [list(r) for r in schedule.ops]
    for group in range(p, m + 1):
        try:
            megatron = generate("interleaved-1f1b", p, m, v=v, microbatch_group_size=group)
        except ValueError:
            continue
        if schedule.placement == megatron.placement and [list(r) for r in megatron.ops] == ops:
            return group
    return None


def is_megatron_interleaved(schedule: Any) -> bool:
    """Whether megatron-core's interleaved 1F1B runs ``schedule``'s order (:func:`megatron_interleaved_group`)."""
    return megatron_interleaved_group(schedule) is not None
