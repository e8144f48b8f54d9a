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

from ..capabilities import Capabilities, Chunks
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
from .common import ScheduleParameterError

__all__ = ["V_CHUNKS", "V_RANKS", "v_block", "v_capabilities", "v_half", "v_min"]


#: Two chunks per rank on the V placement, at least two ranks: what every V schedule takes.
V_CHUNKS = Chunks(
    low=2,
    high=2,
    default=2,
    refusal="{name} runs on the V placement with 2 chunks per rank: v must be 2 (or not given), got v={v}",
)
V_RANKS = (
    "{name} needs p >= 2 ranks (the V placement puts stages r and 2p-1-r on rank r), got p={p}; with one rank use 1f1b"
)


def v_capabilities(peak: str | None = None, **more: object) -> Capabilities:
    """A V schedule's declaration: ``peak`` names its fixed memory (None: it takes a memory limit)."""
    fixed = None
    if peak is not None:
        fixed = (
            "{name} has a fixed activation memory (" + peak + " M_a); it does not take memory_limit "
            "(got {limit!r}); use v-zb for a schedule within a given limit"
        )
    return Capabilities(chunks=V_CHUNKS, min_p=2, too_few_ranks=V_RANKS, fixed_memory=fixed, **more)  # type: ignore[arg-type]


# ---- building-block schedules ---------------------------------------------------------------
def v_min(p: int, m: int) -> Schedule:
    """V-Min: the building block with about 1/3 of 1F1B's activation memory."""
    return generate_from_block(v_min_block(p), p, m, name="v-min")


def v_half(p: int, m: int) -> Schedule:
    """V-Half: the building block with about 1/2 of 1F1B's activation memory."""
    return generate_from_block(v_half_block(p), p, m, name="v-half")


def v_block(p: int, m: int, *, block_file: str | Path | None = None, block: object = None) -> Schedule:
    """A schedule from a user's building block: ``block_file`` (JSON) or ``block`` (a
    :class:`BuildingBlock`, a dict in the JSON format, or ``"v-min"`` / ``"v-half"``)."""
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


register(
    ScheduleInfo(
        "v-min",
        v_min,
        "v",
        True,
        "",
        "V-Min building block: ~1/3 of 1F1B's activation memory ((p+4)//3 M_a), bubble ~2/3 of 1F1B's",
        family="v-shape",
        capabilities=v_capabilities("(p+4)//3"),
    )
)
register(
    ScheduleInfo(
        "v-half",
        v_half,
        "v",
        True,
        "",
        "V-Half building block: ~1/2 of 1F1B's activation memory ((p+2)//2 M_a), bubble ~1/2 of 1F1B's",
        family="v-shape",
        capabilities=v_capabilities("(p+2)//2"),
    )
)
register(
    ScheduleInfo(
        "v-block",
        v_block,
        "v",
        True,
        "without block_file (a JSON building block) or block: the V-Half block",
        "a user's building block (JSON: per-rank offsets of F f B b [W w] + interval), repeated and squeezed",
        family="v-shape",
        capabilities=v_capabilities("the block's", block_file=True, keywords=("block",)),
    )
)
