"""The text the schedule commands print: aligned tables, numbers, a simulation's summary and its
data-parallel part, and the building block a schedule was made from."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ..schedules.schedule import Schedule

if TYPE_CHECKING:
    from ..analysis.simulate import SimResult


def fmt_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(map(str, header))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def num(x: float) -> str:
    return f"{x:.6g}"


def summary(schedule: Schedule, result: SimResult) -> str:
    worst = max(range(schedule.num_ranks), key=lambda r: result.peak_activations[r])
    lines = [
        f"schedule        {schedule.name} ({schedule.placement.style} placement): p={schedule.num_ranks} "
        f"m={schedule.num_microbatches} v={schedule.chunks_per_rank} stages={schedule.num_stages}",
        f"makespan        {num(result.makespan)}",
        f"bubble rate     {result.bubble_rate:.4f} (longest per-rank span)",
        f"sync bubble     {result.sync_bubble_rate:.4f} (global makespan)",
        f"peak activation {num(result.peak_activations[worst])} stage units = "
        f"{num(result.peak_activations_1f1b_units[worst])} 1F1B units (rank {worst})",
        f"communication   {result.p2p_messages} p2p messages, {result.local_handoffs} local hand-offs",
    ]
    block = building_block_of(schedule)
    if block is not None:
        bound, steady = num(block["memory_bound"]), num(block["steady_peak"])  # type: ignore[arg-type]
        lines.append(
            f"building block  {block['block']}: interval {block['interval']} slots, lifespan {block['lifespan']} "
            f"slots, memory bound {bound} M_a (steady-state peak {steady} M_a)"
        )
    lines.append("")
    rows = [
        [
            r,
            num(result.busy[r]),
            num(result.idle[r]),
            f"{result.bubble_rate_per_rank[r]:.4f}",
            f"{result.sync_bubble_rate_per_rank[r]:.4f}",
            num(result.peak_activations[r]),
            num(result.peak_activations_1f1b_units[r]),
        ]
        for r in range(schedule.num_ranks)
    ]
    header = ["rank", "busy", "idle", "bubble", "sync bubble", "peak act (stage)", "peak act (1F1B)"]
    return "\n".join(lines) + fmt_table(header, rows)


BLOCK_KEYS = ("block", "interval", "lifespan", "memory_bound", "steady_peak")


def building_block_of(schedule: Schedule) -> dict[str, object] | None:
    """The building block a schedule was made from (name, interval and lifespan in slots, memory
    bound and steady-state peak in M_a), or None."""
    if not all(key in schedule.params for key in BLOCK_KEYS):
        return None
    return {key: schedule.params[key] for key in BLOCK_KEYS}


# ---- data parallelism (simulate --dp ...) ---------------------------------------------------------
def data_parallel_summary(result: SimResult) -> str:
    """The --dp part of the simulate report: exposed data-parallel time per rank, chunk reductions."""
    dp = result.data_parallel
    assert dp is not None
    policy = dp.plan.policy
    fsdp = "" if policy.fsdp_max_unsharded is None else f", FSDP with {policy.fsdp_max_unsharded} gathered chunk(s)"
    if policy.grad_reduce_unit is not None:
        fsdp += f", gradients reduced per unit of {policy.grad_reduce_unit} micro-batches"
    dist = ", distributed optimizer (param gather per chunk)" if policy.param_sync else ""
    lines = [
        f"data parallel   dp={dp.dp}, {dp.reduce} per chunk{fsdp}{dist}; times in ms (--costs read as ms)",
        f"iteration       {num(dp.iteration_time)} (compute ends {num(max(dp.compute_end))}, "
        f"worst exposed data-parallel time {num(max(dp.exposed))})",
        "",
    ]
    rows = [
        [
            r,
            num(dp.exposed[r]),
            num(dp.stall[r]),
            num(dp.tail[r]),
            num(dp.stream_busy[r]),
            dp.gathers(r),
            dp.reduction_count(r),
        ]
        for r in range(len(dp.end))
    ]
    header = ["rank", "exposed dp", "gather stall", "drain tail", "stream busy", "gathers", "reductions"]
    lines.append(fmt_table(header, rows))
    lines += ["", "gradient reductions (rank, chunk, stage, start, end):"]
    placement = dp.plan.schedule.placement
    rows = [
        [rank, placement.chunk_of(stage), stage, num(start), num(end)] for rank, stage, start, end in dp.reductions()
    ]
    lines.append(fmt_table(["rank", "chunk", "stage", "start", "end"], rows))
    return "\n".join(lines)
