"""V-shape schedules with controllable memory (Qi et al., "Pipeline Parallelism with Controllable
Memory", NeurIPS 2024).

All run on the V placement (:func:`~megatron_pp_ext.schedules.placement.v_placement`): ``2p``
stages, rank ``r`` holds stage ``r`` (chunk 0) and stage ``2p-1-r`` (chunk 1), so a micro-batch
goes down the ranks on chunk 0, turns on rank ``p-1`` without communication and comes back up
on chunk 1; rank 0 holds the first and the last stage. Backwards are split into ``B`` and ``W``.

* ``v-min`` / ``v-half``: the published building blocks (:mod:`.building_block`) repeated every
  6 unit slots, squeezed and reordered. Peak activations (worst rank, 1F1B-stage units ``M_a``,
  counted from ``F`` to ``W``) ``(p+4)//3`` and ``(p+2)//2`` once ``m`` is large enough for the
  repetition to fill (``m >= 2p`` always is); bubble about 2/3 and 1/2 of 1F1B's at equal
  ``T_F = T_B = T_W``.
* ``v-block``: any building block, from a JSON file (``block_file=``) or given directly
  (``block=`` a :class:`~.building_block.BuildingBlock`, a dict in the file's format, or a
  built-in name); without either it runs the V-Half block.
* ``v-zb``: ZB-V within a memory limit, in :mod:`.zbv`.

The generators only know the schedule IR.
"""

from __future__ import annotations

from pathlib import Path

from ..registry import ScheduleInfo, register
from ..schedule import Schedule
from .building_block import (
    BuildingBlock,
    BuildingBlockError,
    block_from_dict,
    builtin_block,
    generate_from_block,
    load_block,
    v_half_block,
    v_min_block,
)
from .common import ScheduleParameterError, check_int, reject_unsupported

__all__ = ["V_CONSTRAINTS", "check_v_parameters", "v_block", "v_half", "v_min"]


def check_v_parameters(schedule: str, p: object, m: object, v: object) -> None:
    """p >= 2 ranks, m >= 1 micro-batches, and v (if given) 2: what every V schedule needs."""
    check_int("p", p, 1)
    check_int("m", m, 1)
    if p == 1:  # type: ignore[comparison-overlap]
        raise ScheduleParameterError(
            f"{schedule} needs p >= 2 ranks (the V placement puts stages r and 2p-1-r on rank r), got p=1; "
            "with one rank use 1f1b"
        )
    if v is not None:
        check_int("v", v, 1)
        if v != 2:
            raise ScheduleParameterError(
                f"{schedule} runs on the V placement with 2 chunks per rank: v must be 2 (or not given), got v={v}"
            )


def _no_memory_limit(schedule: str, memory_limit: object, peak: str) -> None:
    if memory_limit is not None:
        raise ScheduleParameterError(
            f"{schedule} has a fixed activation memory ({peak} M_a); it does not take memory_limit "
            f"(got {memory_limit!r}); use v-zb for a schedule within a given limit"
        )


# ---- building-block schedules ---------------------------------------------------------------
def v_min(p: int, m: int, *, v: int | None = None, memory_limit: object = None, **unused: object) -> Schedule:
    """V-Min: the building block with about 1/3 of 1F1B's activation memory."""
    check_v_parameters("v-min", p, m, v)
    _no_memory_limit("v-min", memory_limit, "(p+4)//3")
    reject_unsupported("v-min", unused)
    return generate_from_block(v_min_block(p), p, m, name="v-min")


def v_half(p: int, m: int, *, v: int | None = None, memory_limit: object = None, **unused: object) -> Schedule:
    """V-Half: the building block with about 1/2 of 1F1B's activation memory."""
    check_v_parameters("v-half", p, m, v)
    _no_memory_limit("v-half", memory_limit, "(p+2)//2")
    reject_unsupported("v-half", unused)
    return generate_from_block(v_half_block(p), p, m, name="v-half")


def v_block(
    p: int,
    m: int,
    *,
    block_file: str | Path | None = None,
    block: object = None,
    v: int | None = None,
    memory_limit: object = None,
    **unused: object,
) -> Schedule:
    """A schedule from a user's building block: ``block_file`` (JSON) or ``block`` (a
    :class:`BuildingBlock`, a dict in the JSON format, or ``"v-min"`` / ``"v-half"``)."""
    check_v_parameters("v-block", p, m, v)
    _no_memory_limit("v-block", memory_limit, "the block's")
    reject_unsupported("v-block", unused)
    if block_file is not None and block is not None:
        raise ScheduleParameterError("v-block takes block_file or block, not both")
    if block_file is not None:
        if not isinstance(block_file, str | Path):
            raise ScheduleParameterError(f"block_file must be a path to a JSON file, got {block_file!r}")
        chosen = load_block(block_file)
    elif block is None:
        chosen = v_half_block(p)
    elif isinstance(block, BuildingBlock):
        chosen = block
    elif isinstance(block, str):
        chosen = builtin_block(block, p)
    elif isinstance(block, dict):
        chosen = block_from_dict(block)
    else:
        raise ScheduleParameterError(
            f"block must be a BuildingBlock, a dict in the block-file format or a built-in block name, got {block!r}"
        )
    if chosen.num_ranks != p:
        raise BuildingBlockError(
            f"building block {chosen.name!r} lays out {chosen.num_ranks} ranks; it cannot build a schedule "
            f"for p={p} (use p={chosen.num_ranks})"
        )
    schedule = generate_from_block(chosen, p, m, name="v-block")
    if block_file is not None:
        schedule.params["block_file"] = str(block_file)
    return schedule


# ---- V-ZB: greedy list scheduling on the V placement ----------------------------------------
V_CONSTRAINTS = "p >= 2, m >= 1, v = 2 (V placement)"
register(
    ScheduleInfo(
        "v-min",
        v_min,
        "v",
        True,
        V_CONSTRAINTS,
        "V-Min building block: ~1/3 of 1F1B's activation memory ((p+4)//3 M_a), bubble ~2/3 of 1F1B's",
        family="v-shape",
    )
)
register(
    ScheduleInfo(
        "v-half",
        v_half,
        "v",
        True,
        V_CONSTRAINTS,
        "V-Half building block: ~1/2 of 1F1B's activation memory ((p+2)//2 M_a), bubble ~1/2 of 1F1B's",
        family="v-shape",
    )
)
register(
    ScheduleInfo(
        "v-block",
        v_block,
        "v",
        True,
        V_CONSTRAINTS + ", block_file=<JSON building block> (default: the V-Half block)",
        "a user's building block (JSON: per-rank offsets of F f B b [W w] + interval), repeated and squeezed",
        family="v-shape",
    )
)
