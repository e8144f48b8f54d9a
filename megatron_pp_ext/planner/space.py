"""What the planner searches: the search space (:class:`SearchSpace`) and one point of it (:class:`Config`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..schedules import registry
from ..schedules.layer_split import LayerSplit

NO_PIPELINE = "none (pp=1)"  # how a configuration without pipeline parallelism is listed
NO_PIPELINE_SCHEDULE = "1f1b"  # the schedule that runs it (one chunk: megatron's no-pipelining loop)


def default_schedules() -> tuple[str, ...]:
    """Every registered schedule except ``v-block`` (which, without a block file, is ``v-half``)."""
    return tuple(n for n in registry.names() if n != "v-block")


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order, found in pairs ``(k, n // k)`` up to ``sqrt(n)``."""
    low, high = [], []
    k = 1
    while k * k <= n:
        if n % k == 0:
            low.append(k)
            if k * k != n:
                high.append(n // k)
        k += 1
    return low + high[::-1]


@dataclass(frozen=True)
class SearchSpace:
    """Values to try; ``None`` means every valid value."""

    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    micro_batch: tuple[int, ...] | None = None  # default: powers of two up to 16 (and the preset's)
    virtual: tuple[int, ...] = (1, 2, 3, 4)  # chunks per rank to try for loop placements that take v
    recompute: tuple[str, ...] = ("none", "selective", "full")
    schedules: tuple[str, ...] | None = None  # default: every registered schedule
    memory_limits: tuple[str, ...] = ()  # extra memory limits ("p", "2p", "12") for memory-aware schedules
    layer_split: str = "auto"  # auto | even | embedding-loss | search (the layout axis, planner/layer_layouts.py)
    max_tp: int | None = None  # default: GPUs per node
    fsdp: tuple[bool, ...] | None = None  # FSDP off / on per candidate (planner/fsdp_axis.py); default: off only
    unit_sizes: tuple[int, ...] | None = None  # zeropp's unit sizes U; default: every divisor of m
    layout: str | None = None  # one given layer layout (megatron's layout text) instead of the layout search
    # a training run's own split (megatron's uneven-split flags, fixed: auto must not change the layers megatron
    # builds): every candidate is evaluated under it as its placement maps it (variants.py), or skipped with why
    given_split: LayerSplit | None = None


@dataclass(frozen=True)
class Config:
    """One point of the grid."""

    schedule: str
    tp: int
    pp: int
    dp: int
    micro_batch: int
    num_microbatches: int
    chunks: int  # model chunks per rank (from the schedule's placement)
    placement: str
    recompute: str
    split: tuple[int, ...]  # layers per model slice
    v_flag: int | None = None  # megatron's virtual pipeline size to pass (None: schedule default)
    memory_limit: str | None = None
    costs_flag: str | None = None  # --pipeline-costs for cost-aware schedules
    unit_size: int | None = None  # --pipeline-unit-size (zeropp; None: the schedule's default)
    fsdp: bool = False  # --pipeline-fsdp
    layout: str | None = None  # a planned layer layout (megatron's layout text); None: the split policy's

    @property
    def id(self) -> str:
        name = self.schedule + (f"@{self.memory_limit}" if self.memory_limit else "")
        return (
            f"{name}-t{self.tp}p{self.pp}d{self.dp}-b{self.micro_batch}m{self.num_microbatches}"
            f"-v{self.chunks}-{self.recompute}"
            + (f"-u{self.unit_size}" if self.unit_size is not None else "")
            + ("-fsdp" if self.fsdp else "")
            + ("-layout" if self.layout else "")
        )

    @property
    def uneven(self) -> bool:
        """The split policy's embedding-and-loss split (a planned layout has its own flags)."""
        return self.layout is None and len(set(self.split)) > 1
