"""Placements: which rank and which local chunk hold each pipeline stage.

A pipeline has ``stages_per_replica`` stages (model slices in model order). Most
schedules run one model replica; bidirectional schedules (BitPipe, Chimera) run
two replicas whose micro-batches travel in opposite directions. Stages get
global ids: replica ``k`` owns ids ``k * S .. (k + 1) * S - 1`` and global
stage ``g`` runs the model slice ``g % S``.

Styles:

* ``loop``: stage ``s`` on rank ``s % P``, chunk ``s // P`` (Megatron interleaved;
  ``v = 1`` is plain 1F1B/GPipe).
* ``v``: ``2P`` stages; rank ``i`` holds stage ``i`` (chunk 0) and ``2P-1-i`` (chunk 1).
* ``bidirectional``: two V-shaped replicas (BitPipe). Down replica: chunk 0 of
  rank ``d`` is stage ``d``, chunk 2 is stage ``2P-1-d``. Up replica: chunk 1 of
  rank ``d`` is its stage ``P-1-d``, chunk 3 its stage ``P+d``.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache

from .ir import ScheduleError

STYLES = ("loop", "v", "bidirectional")


@dataclass(frozen=True)
class Placement:
    """Maps every global stage to ``(rank, chunk)``; plain data."""

    style: str
    num_ranks: int
    stages_per_replica: int
    locations: tuple[tuple[int, int], ...]  # global stage -> (rank, chunk)
    num_replicas: int = 1

    def __post_init__(self) -> None:
        if self.num_ranks < 1:
            raise ScheduleError(f"placement needs at least one rank, got {self.num_ranks}")
        expected = self.stages_per_replica * self.num_replicas
        if len(self.locations) != expected:
            raise ScheduleError(
                f"placement lists {len(self.locations)} stages, expected "
                f"{self.stages_per_replica} x {self.num_replicas} replicas = {expected}"
            )
        seen: dict[tuple[int, int], int] = {}
        for stage, (rank, chunk) in enumerate(self.locations):
            if not 0 <= rank < self.num_ranks:
                raise ScheduleError(f"stage {stage} placed on rank {rank}, not in 0..{self.num_ranks - 1}")
            if chunk < 0:
                raise ScheduleError(f"stage {stage} placed on negative chunk {chunk}")
            if (rank, chunk) in seen:
                raise ScheduleError(
                    f"stages {seen[(rank, chunk)]} and {stage} both placed on rank {rank} chunk {chunk}"
                )
            seen[(rank, chunk)] = stage
        by_rank: dict[int, list[int]] = {}  # one pass: linear in the number of stages, at any p
        for rank, chunk in self.locations:
            by_rank.setdefault(rank, []).append(chunk)
        for rank in range(self.num_ranks):
            chunks = sorted(by_rank.get(rank, []))
            if chunks != list(range(len(chunks))):
                shown = chunks if len(chunks) <= 16 else [*chunks[:16], "..."]
                raise ScheduleError(f"rank {rank} has chunks {shown}; chunks must be numbered 0..n-1")

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        return len(self.locations)

    def rank_of(self, stage: int) -> int:
        return self.locations[stage][0]

    def chunk_of(self, stage: int) -> int:
        return self.locations[stage][1]

    def replica_of(self, stage: int) -> int:
        return stage // self.stages_per_replica

    def model_slice_of(self, stage: int) -> int:
        """Index of the model slice (0 = embedding side) that this stage runs."""
        return stage % self.stages_per_replica

    def is_first(self, stage: int) -> bool:
        return self.model_slice_of(stage) == 0

    def is_last(self, stage: int) -> bool:
        return self.model_slice_of(stage) == self.stages_per_replica - 1

    def next_stage(self, stage: int) -> int | None:
        return None if self.is_last(stage) else stage + 1

    def prev_stage(self, stage: int) -> int | None:
        return None if self.is_first(stage) else stage - 1

    def first_stage(self, replica: int) -> int:
        return replica * self.stages_per_replica

    @cached_property
    def _by_rank(self) -> tuple[tuple[int, ...], ...]:
        table: list[list[tuple[int, int]]] = [[] for _ in range(self.num_ranks)]
        for stage, (rank, chunk) in enumerate(self.locations):
            table[rank].append((chunk, stage))
        return tuple(tuple(s for _, s in sorted(row)) for row in table)

    def stages_on_rank(self, rank: int) -> tuple[int, ...]:
        """Global stages held by ``rank``, indexed by local chunk."""
        return self._by_rank[rank]

    def stage_at(self, rank: int, chunk: int) -> int:
        return self._by_rank[rank][chunk]

    @property
    def chunks_per_rank(self) -> int:
        return max(len(row) for row in self._by_rank)

    @property
    def stages_per_rank_per_replica(self) -> float:
        """How many stages of one replica a rank holds (``v`` for loop, 2 for V)."""
        return self.stages_per_replica / self.num_ranks

    def describe(self) -> str:
        rows = []
        for rank in range(self.num_ranks):
            cells = ", ".join(f"chunk {c}: stage {s}" for c, s in enumerate(self.stages_on_rank(rank)))
            rows.append(f"rank {rank}: {cells}")
        return f"{self.style} placement, {self.num_stages} stages on {self.num_ranks} ranks\n" + "\n".join(rows)

    def to_spec(self) -> str:
        """Compact text form used in CSV headers: ``style:P:S:R`` or ``explicit`` tables."""
        locs = ";".join(f"{r}/{c}" for r, c in self.locations)
        return f"{self.style}|{self.num_ranks}|{self.stages_per_replica}|{self.num_replicas}|{locs}"

    @classmethod
    def from_spec(cls, spec: str) -> Placement:
        try:
            style, ranks, spr, replicas, locs = spec.split("|")
            locations = tuple(tuple(int(x) for x in cell.split("/")) for cell in locs.split(";"))
            return cls(style, int(ranks), int(spr), locations, int(replicas))  # type: ignore[arg-type]
        except (ValueError, TypeError) as exc:
            if isinstance(exc, ScheduleError):
                raise
            raise ScheduleError(f"cannot parse placement spec {spec!r}: {exc}") from None


# ---- constructors -------------------------------------------------------------------------
def _check_ranks(num_ranks: int) -> None:
    if not isinstance(num_ranks, int) or num_ranks < 1:
        raise ScheduleError(f"pipeline parallel size must be an integer >= 1, got {num_ranks!r}")


@lru_cache(maxsize=64, typed=True)  # placements are immutable: generators and timers share them
def loop_placement(num_ranks: int, chunks: int = 1) -> Placement:
    _check_ranks(num_ranks)
    if chunks < 1:
        raise ScheduleError(f"virtual pipeline size must be >= 1, got {chunks}")
    stages = num_ranks * chunks
    return Placement("loop", num_ranks, stages, tuple((s % num_ranks, s // num_ranks) for s in range(stages)))


@lru_cache(maxsize=64, typed=True)  # placements are immutable: generators and timers share them
def v_placement(num_ranks: int) -> Placement:
    _check_ranks(num_ranks)
    p = num_ranks
    locs = [(s, 0) if s < p else (2 * p - 1 - s, 1) for s in range(2 * p)]
    return Placement("v", p, 2 * p, tuple(locs))


@lru_cache(maxsize=64, typed=True)  # placements are immutable: generators and timers share them
def bidirectional_placement(num_ranks: int) -> Placement:
    _check_ranks(num_ranks)
    p = num_ranks
    down = [(s, 0) if s < p else (2 * p - 1 - s, 2) for s in range(2 * p)]
    up = [(p - 1 - s, 1) if s < p else (s - p, 3) for s in range(2 * p)]
    return Placement("bidirectional", p, 2 * p, tuple(down + up), num_replicas=2)


def make_placement(style: str, num_ranks: int, chunks: int = 1) -> Placement:
    if style == "loop":
        return loop_placement(num_ranks, chunks)
    if style == "v":
        return v_placement(num_ranks)
    if style == "bidirectional":
        return bidirectional_placement(num_ranks)
    raise ScheduleError(f"unknown placement style {style!r}; valid: {', '.join(STYLES)}")
