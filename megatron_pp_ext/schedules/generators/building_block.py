"""Building blocks (Qi et al., "Pipeline Parallelism with Controllable Memory", NeurIPS 2024).

A **building block** lays out one micro-batch's passes on every rank of a V placement
(:func:`~megatron_pp_ext.schedules.placement.v_placement`: rank ``r`` holds stage ``r`` as
chunk 0 and stage ``2p-1-r`` as chunk 1) as start offsets in unit time slots. Six passes per
rank, named as in the paper:

====  =========================================  ====================================
pass  what                                       op on rank ``r`` for micro-batch ``k``
====  =========================================  ====================================
F     chunk-0 forward                            ``F(r, k)``
f     chunk-1 forward                            ``F(2p-1-r, k)``
B     chunk-1 backward (input gradient)          ``B(2p-1-r, k)``
b     chunk-0 backward (input gradient)          ``B(r, k)``
W     chunk-1 weight gradient (after ``B``)      ``W(2p-1-r, k)``
w     chunk-0 weight gradient (after ``b``)      ``W(r, k)``
====  =========================================  ====================================

Every pass takes one slot and a hop between ranks costs nothing, so a pass may start in
the slot after the pass it depends on ends. ``W`` / ``w`` offsets may be left out: they then
fill the rank's free slots (residues modulo the interval), ``W`` the first free one after
``B``, then ``w`` the first other free one after ``b``.

From a block and ``m`` (:func:`generate_from_block`):

1. **repeat**: micro-batch ``k`` runs the block shifted by ``k * interval`` slots; a legal block
   repeats without collision (on each rank its six offsets differ modulo the interval);
2. **squeeze**: the schedule is the per-rank *order* of the passes; executing that order as
   soon as dependencies allow removes the empty slots without changing it (this is what the
   simulator and the runtime do);
3. **reorder** the warm-up and cool-down (the passes outside the full repetition; the steady
   state keeps the block's order, which is what keeps e.g. V-Half free of bubbles when T_F, T_B
   and T_W differ): walking the squeezed timeline in time order, each pass moves to the earliest
   idle slot after its inputs (and after the same pass of the previous micro-batch on its rank),
   and a backward may also take an earlier ``W``'s slot (the ``W`` moves to the backward's: the
   cool-down then runs backwards back to back and fills the gaps with ``W``). A move never lets
   the rank's live activations exceed the block's steady-state peak, so reordering never raises
   the peak memory, and never puts two messages between neighbouring ranks in opposite orders on
   the two ranks (see :mod:`.block_schedule`: the lowering would otherwise make a rank wait). Squeeze and
   reorder repeat until nothing moves (at most four rounds).

Memory (:func:`block_info`): an activation lives from its forward's start to its weight
pass's end. On rank ``r`` chunk ``c``'s activation lifespan is ``l[r][c]`` slots; with one
block every ``interval`` slots at most ``ceil(l / interval)`` copies are alive, each of one
V-stage activation (``M_a / 2`` in 1F1B units, as a V stage holds half the layers of a 1F1B
stage). The bound ``sum_c ceil(l[r][c] / interval)`` is the paper's ``ceil(lifespan /
interval) x block memory`` per chunk; the exact steady-state peak (the most activations alive
at any time once the repetition is full) is reported next to it and is what a long enough
schedule reaches: ``(p+4)//3`` M_a for V-Min and ``(p+2)//2`` for V-Half.

A user's block is a small JSON file (see :func:`block_from_dict`)::

    {"name": "my-block", "interval": 6,
     "offsets": [{"F": 0, "f": 3, "B": 4, "b": 7},      # rank 0 (W, w: free slots)
                 {"F": 1, "f": 2, "B": 5, "b": 6}]}     # rank 1

or, per pass, ``"offsets": {"F": [0, 1], "f": [3, 2], "B": [4, 5], "b": [7, 6]}``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..engine import backward, forward, pass_op
from ..ir import Op
from ..placement import v_placement
from ..schedule import Schedule, build_schedule
from .block_schedule import compact
from .common import ScheduleParameterError, check_int

__all__ = [
    "LETTERS",
    "PASSES",
    "BlockInfo",
    "BuildingBlock",
    "BuildingBlockError",
    "block_from_dict",
    "block_info",
    "builtin_block",
    "generate_from_block",
    "load_block",
    "v_half_block",
    "v_min_block",
]

#: Pass names of a block, in the order :attr:`BuildingBlock.offsets` stores them.
PASSES = ("F", "f", "B", "b", "W", "w")
_REQUIRED = PASSES[:4]
_F, _FF, _B, _BB, _W, _WW = range(6)
#: The letters as the engine's passes on a V rank (:mod:`..engine`), in :data:`PASSES` order: (pass,
#: whether the letter is that backward pass's deferred ``W``).
LETTERS = (
    (forward(0, 2), False),
    (forward(1, 2), False),
    (backward(1, 2), False),
    (backward(0, 2), False),
    (backward(1, 2), True),
    (backward(0, 2), True),
)
#: The paper's repeating interval: six unit passes per rank and micro-batch.
DEFAULT_INTERVAL = 6


class BuildingBlockError(ScheduleParameterError):
    """A building block that cannot be repeated into a valid schedule."""


@dataclass(frozen=True)
class BuildingBlock:
    """Start slots of one micro-batch's passes on each rank, repeated every ``interval`` slots.

    ``offsets[r]`` holds the six offsets of rank ``r`` in :data:`PASSES` order (W and w filled
    in). Build with :meth:`create` (checks it) or :func:`v_min_block` / :func:`v_half_block` /
    :func:`load_block`.
    """

    name: str
    interval: int
    offsets: tuple[tuple[int, int, int, int, int, int], ...]

    @property
    def num_ranks(self) -> int:
        return len(self.offsets)

    @classmethod
    def create(
        cls, name: str, interval: int, offsets: Sequence[Mapping[str, int]] | Mapping[str, Sequence[int]]
    ) -> BuildingBlock:
        """Check a block and fill in missing W / w offsets (see the module doc)."""
        check_int("interval", interval, 1)
        if interval < len(PASSES):
            raise BuildingBlockError(
                f"block {name!r}: interval must be >= 6 slots (a rank runs six unit passes per micro-batch), "
                f"got {interval}"
            )
        rows = _rows(offsets)
        if len(rows) < 2:
            raise BuildingBlockError(f"block {name!r}: a V-shape block needs offsets for p >= 2 ranks, got {len(rows)}")
        filled = []
        for rank, row in enumerate(rows):
            unknown = sorted(set(row) - set(PASSES))
            if unknown:
                raise BuildingBlockError(
                    f"block {name!r} rank {rank}: unknown pass(es) {', '.join(map(repr, unknown))}; "
                    f"passes are {', '.join(PASSES)}"
                )
            missing = [x for x in _REQUIRED if x not in row]
            if missing:
                raise BuildingBlockError(f"block {name!r} rank {rank}: no offset for pass(es) {', '.join(missing)}")
            for x, value in row.items():
                if isinstance(value, bool) or not isinstance(value, int):
                    raise BuildingBlockError(
                        f"block {name!r} rank {rank}: offset of {x} must be an integer slot, got {value!r}"
                    )
            filled.append(_fill_w(name, rank, dict(row), interval))
        block = cls(str(name), interval, tuple(filled))
        block._check()
        return block

    def _check(self) -> None:
        p, t = self.num_ranks, self.interval
        for rank, off in enumerate(self.offsets):
            seen: dict[int, str] = {}
            for x, slot in zip(PASSES, off, strict=True):
                other = seen.get(slot % t)
                if other is not None:
                    raise BuildingBlockError(
                        f"block {self.name!r} rank {rank}: passes {other} (slot {off[PASSES.index(other)]}) and {x} "
                        f"(slot {slot}) collide when the block repeats every {t} slots (equal modulo {t}); "
                        "a rank's six offsets must differ modulo the interval"
                    )
                seen[slot % t] = x
        # (pass, rank) must start after (pass', rank') ends: one slot per pass, free hops.
        needs: list[tuple[str, int, str, int]] = []
        for r in range(p):
            if r > 0:
                needs += [("F", r, "F", r - 1), ("B", r, "B", r - 1)]
            if r < p - 1:
                needs += [("f", r, "f", r + 1), ("b", r, "b", r + 1)]
            needs += [("W", r, "B", r), ("w", r, "b", r)]
        needs += [("f", p - 1, "F", p - 1), ("B", 0, "f", 0), ("b", p - 1, "B", p - 1)]
        for x, r, y, q in needs:
            if self.slot(r, x) < self.slot(q, y) + 1:
                where = "its own" if r == q else f"rank {q}'s"
                raise BuildingBlockError(
                    f"block {self.name!r}: {x} on rank {r} starts at slot {self.slot(r, x)}, before {where} {y} "
                    f"(slot {self.slot(q, y)}) ends; it needs that pass's output, so it must start at slot >= "
                    f"{self.slot(q, y) + 1}"
                )

    def slot(self, rank: int, name: str) -> int:
        return self.offsets[rank][PASSES.index(name)]

    def ops(self, rank: int, microbatch: int) -> tuple[Op, ...]:
        """The six ops of ``rank`` for ``microbatch`` in :data:`PASSES` order (:data:`LETTERS`)."""
        stages = (rank, 2 * self.num_ranks - 1 - rank)  # the V placement's chunks 0 and 1
        return tuple(pass_op(stages, which, microbatch, weight) for which, weight in LETTERS)

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "interval": self.interval,
            "offsets": [dict(zip(PASSES, off, strict=True)) for off in self.offsets],
        }


def _rows(offsets: object) -> list[Mapping[str, object]]:
    if isinstance(offsets, Mapping):  # {"F": [per rank], ...}
        lengths = set()
        for x, values in offsets.items():
            if isinstance(values, str | bytes) or not isinstance(values, Sequence):
                raise BuildingBlockError(f"offsets of pass {x!r} must be a list with one slot per rank, got {values!r}")
            lengths.add(len(values))
        if len(lengths) != 1:
            raise BuildingBlockError(f"per-pass offset lists differ in length: {sorted(lengths)}; give one per rank")
        n = lengths.pop()
        return [{x: values[r] for x, values in offsets.items()} for r in range(n)]
    if isinstance(offsets, str | bytes) or not isinstance(offsets, Sequence):
        raise BuildingBlockError(f"offsets must be a list (one object per rank) or an object of lists, got {offsets!r}")
    rows = []
    for rank, row in enumerate(offsets):
        if not isinstance(row, Mapping):
            raise BuildingBlockError(f"offsets of rank {rank} must be an object such as {{'F': 0, ...}}, got {row!r}")
        rows.append(row)
    return rows


def _fill_w(name: str, rank: int, row: dict[str, object], interval: int) -> tuple[int, int, int, int, int, int]:
    """Give W (then w) the first residue not taken by the other passes, after B (b)."""
    for x, after in (("W", "B"), ("w", "b")):
        if x in row:
            continue
        taken = {int(v) % interval for v in row.values()}  # type: ignore[call-overload]
        start = int(row[after]) + 1  # type: ignore[call-overload]
        for slot in range(start, start + interval):
            if slot % interval not in taken:
                row[x] = slot
                break
        else:
            raise BuildingBlockError(
                f"block {name!r} rank {rank}: no free slot left for {x} in an interval of {interval} "
                "(each rank runs six passes per micro-batch)"
            )
    return tuple(int(row[x]) for x in PASSES)  # type: ignore[call-overload]


# ---- the published blocks -------------------------------------------------------------------
def v_min_block(p: int) -> BuildingBlock:
    """V-Min: F at i, f at 2p-i-1, B at 2p+g+i, b at 4p+g-i-1, g = 2 if p % 3 == 0 else 0."""
    check_int("p", p, 2)
    g = 2 if p % 3 == 0 else 0
    offs = [{"F": i, "f": 2 * p - i - 1, "B": 2 * p + g + i, "b": 4 * p + g - i - 1} for i in range(p)]
    return BuildingBlock.create("v-min", DEFAULT_INTERVAL, offs)


def v_half_block(p: int) -> BuildingBlock:
    """V-Half: F at 2i, f at 3p-i-2, B at 3p+g+2i-1, b at 6p+g-i-2, g = 3 if p % 2 == 0 else 0."""
    check_int("p", p, 2)
    g = 3 if p % 2 == 0 else 0
    offs = [{"F": 2 * i, "f": 3 * p - i - 2, "B": 3 * p + g + 2 * i - 1, "b": 6 * p + g - i - 2} for i in range(p)]
    return BuildingBlock.create("v-half", DEFAULT_INTERVAL, offs)


_BUILTIN = {"v-min": v_min_block, "v-half": v_half_block}


def builtin_block(name: str, p: int) -> BuildingBlock:
    """A published block by name (``v-min`` or ``v-half``) for ``p`` ranks."""
    maker = _BUILTIN.get(str(name).strip().lower())
    if maker is None:
        raise BuildingBlockError(f"unknown building block {name!r}; built-in blocks: {', '.join(_BUILTIN)}")
    return maker(p)


# ---- user blocks ----------------------------------------------------------------------------
def block_from_dict(data: Mapping[str, object], source: str = "<block>") -> BuildingBlock:
    """A block from ``{"name": ..., "interval": 6, "offsets": ...}`` (name optional, interval default 6)."""
    if not isinstance(data, Mapping):
        raise BuildingBlockError(f"{source}: a building block is a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - {"name", "interval", "offsets", "comment"})
    if unknown:
        raise BuildingBlockError(f"{source}: unknown key(s) {', '.join(unknown)}; keys: name, interval, offsets")
    if "offsets" not in data:
        raise BuildingBlockError(f"{source}: no 'offsets' (one object of pass offsets per rank)")
    default_name = "block" if source == "<block>" else Path(source).stem
    try:
        return BuildingBlock.create(
            str(data.get("name", default_name)),
            data.get("interval", DEFAULT_INTERVAL),  # type: ignore[arg-type]
            data["offsets"],  # type: ignore[arg-type]
        )
    except ScheduleParameterError as exc:
        raise BuildingBlockError(str(exc) if source == "<block>" else f"{source}: {exc}") from None


def load_block(path: str | Path) -> BuildingBlock:
    """Read a block from a JSON file (format in the module doc)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise BuildingBlockError(f"cannot read building block file {path}: {exc.strerror or exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BuildingBlockError(f"{path}: not valid JSON: {exc}") from None
    return block_from_dict(data, str(path))


# ---- memory ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class BlockInfo:
    """What a block implies. Slots are unit passes; memory in 1F1B-stage units (``M_a``)."""

    name: str
    p: int
    interval: int
    lifespan: int  # max over ranks: first forward's start to last weight pass's end (slots)
    activation_lifespans: tuple[tuple[int, int], ...]  # per rank: (chunk 0: F..w, chunk 1: f..W) in slots
    memory_bound: float  # max over ranks of sum_c ceil(l[r][c] / interval) x M_a/2
    steady_peak: tuple[float, ...]  # per rank, exact peak once the repetition is full
    offsets: tuple[tuple[int, int, int, int, int, int], ...]

    @property
    def peak(self) -> float:
        return max(self.steady_peak)

    def describe(self) -> str:
        lines = [
            f"building block {self.name}: p={self.p}, interval {self.interval} slots, lifespan {self.lifespan} slots",
            f"memory bound {self.memory_bound:g} M_a (sum over chunks of ceil(lifespan/interval) x M_a/2), "
            f"steady-state peak {self.peak:g} M_a (1F1B stage units)",
            "rank  " + "  ".join(f"{x:>3}" for x in PASSES) + "  lifespan(c0,c1)  peak",
        ]
        for r, off in enumerate(self.offsets):
            l0, l1 = self.activation_lifespans[r]
            lines.append(
                f"{r:>4}  " + "  ".join(f"{s:>3}" for s in off) + f"  {l0:>6},{l1:<8}  {self.steady_peak[r]:g}"
            )
        return "\n".join(lines)


def _steady_peaks(block: BuildingBlock) -> list[int]:
    """Per rank: most V-stage activations alive after any slot once blocks repeat forever."""
    t = block.interval
    peaks = []
    for off in block.offsets:
        spans = ((off[_F], off[_WW]), (off[_FF], off[_W]))  # alive from the forward's slot until the W's slot
        best = 0
        for phase in range(t):
            now = phase + t * (1 + max(off) // t)  # a slot after every span of block 0 began
            # copies k with start + k t <= now < end + k t
            alive = sum((now - s) // t - (now - e) // t for s, e in spans)
            best = max(best, alive)
        peaks.append(best)
    return peaks


def block_info(block: BuildingBlock | str, p: int | None = None) -> BlockInfo:
    """Lifespan and memory of ``block`` (a :class:`BuildingBlock`, or ``"v-min"`` / ``"v-half"`` with ``p``)."""
    if isinstance(block, str):
        if p is None:
            raise BuildingBlockError(f"block_info({block!r}) needs p (the number of ranks)")
        block = builtin_block(block, p)
    elif p is not None and p != block.num_ranks:
        raise BuildingBlockError(f"block {block.name!r} is laid out for p={block.num_ranks}, got p={p}")
    t = block.interval
    lifespans = tuple((off[_WW] + 1 - off[_F], off[_W] + 1 - off[_FF]) for off in block.offsets)
    return BlockInfo(
        name=block.name,
        p=block.num_ranks,
        interval=t,
        lifespan=max(max(off) + 1 - min(off) for off in block.offsets),
        activation_lifespans=lifespans,
        memory_bound=max(math.ceil(a / t) + math.ceil(b / t) for a, b in lifespans) / 2,
        steady_peak=tuple(x / 2 for x in _steady_peaks(block)),
        offsets=block.offsets,
    )


# ---- block -> schedule ----------------------------------------------------------------------
def generate_from_block(block: BuildingBlock, p: int, m: int, name: str | None = None) -> Schedule:
    """Repeat ``block`` for ``m`` micro-batches, squeeze and reorder (module doc) into a V schedule."""
    check_int("p", p, 2)
    check_int("m", m, 1)
    if p != block.num_ranks:
        raise BuildingBlockError(
            f"block {block.name!r} is laid out for p={block.num_ranks} ranks, cannot build a schedule for p={p}"
        )
    caps = _steady_peaks(block)
    order = compact(block, m, caps)
    info = block_info(block)
    return build_schedule(
        name or block.name,
        v_placement(p),
        m,
        order,
        block=block.name,
        interval=block.interval,
        lifespan=info.lifespan,
        memory_bound=info.memory_bound,
        steady_peak=info.peak,
    )
