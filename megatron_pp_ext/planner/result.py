"""What the planner finds: a fitting configuration with its estimates (:class:`PlanRow`) and a search's
outcome (:class:`PlanResult`: the ranked rows and why the others were left out)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from .memory import GIB, RankMemory
from .space import NO_PIPELINE, Config


@dataclass
class PlanRow:
    """A configuration that fits, with its estimates (times in seconds, memory in bytes)."""

    config: Config
    iteration_time: float
    pipeline_time: float  # simulated makespan of the schedule
    dp_time: float  # gradient reduction left after the pipeline (per-chunk reductions overlap, dp_stream.py)
    optimizer_time: float
    samples_per_second: float
    tokens_per_second_per_gpu: float
    tflops_per_gpu: float
    mfu: float
    bubble_rate: float  # zero-bubble paper's (longest per-rank span)
    sync_bubble_rate: float  # global makespan
    memory: list[RankMemory]
    extrapolated: bool = False
    approximate: bool = False  # extrapolated although the anchors were not on a line (m > 8p)
    rank: int = 0
    gathers: int = 0  # FSDP all-gathers per iteration (worst rank)

    @property
    def peak_memory(self) -> float:
        return max(m.total for m in self.memory)

    @property
    def peak_rank(self) -> int:
        return max(self.memory, key=lambda m: m.total).rank

    def to_json_dict(self, per_rank: bool = True) -> dict[str, Any]:
        c = self.config
        out: dict[str, Any] = {
            "rank": self.rank,
            "id": c.id,
            "schedule": c.schedule,
            "memory_limit": c.memory_limit,
            "tp": c.tp,
            "pp": c.pp,
            "dp": c.dp,
            "micro_batch": c.micro_batch,
            "num_microbatches": c.num_microbatches,
            "chunks": c.chunks,
            "placement": c.placement,
            "recompute": c.recompute,
            "layer_split": list(c.split),
            "iteration_time_s": round(self.iteration_time, 6),
            "pipeline_time_s": round(self.pipeline_time, 6),
            "dp_time_s": round(self.dp_time, 6),
            "optimizer_time_s": round(self.optimizer_time, 6),
            "samples_per_second": round(self.samples_per_second, 4),
            "tokens_per_second_per_gpu": round(self.tokens_per_second_per_gpu, 2),
            "tflops_per_gpu": round(self.tflops_per_gpu, 3),
            "mfu": round(self.mfu, 5),
            "bubble_rate": round(self.bubble_rate, 5),
            "sync_bubble_rate": round(self.sync_bubble_rate, 5),
            "peak_memory_gib": round(self.peak_memory / GIB, 3),
            "peak_memory_rank": self.peak_rank,
            "extrapolated": self.extrapolated,
            "approximate": self.approximate,
        }
        if c.layout is not None:
            out["layout"] = c.layout
        if c.unit_size is not None:
            out["unit_size"] = c.unit_size
        if c.fsdp:
            out["fsdp"] = True
            out["gathers_per_iteration"] = self.gathers
        if per_rank:
            out["memory_per_rank"] = [m.to_json_dict() for m in self.memory]
        return out


@dataclass
class PlanResult:
    rows: list[PlanRow]  # fitting configurations, best first
    evaluated: int  # configurations considered (after shape checks)
    over_budget: int
    over_budget_best: dict[str, float]  # schedule -> smallest peak memory seen (bytes) among those over
    inapplicable: dict[str, Counter[str]]  # schedule -> reason -> count
    elapsed: float
    cpu: float  # CPU seconds of this process (the machine may be shared)
    stats: dict[str, int]
    budget_bytes: float

    def best_per_schedule(self) -> list[PlanRow]:
        """Each schedule's best row; configurations without a pipeline (pp=1) are one group of their own."""
        seen: dict[str, PlanRow] = {}
        for row in self.rows:
            key = row.config.schedule + (f"@{row.config.memory_limit}" if row.config.memory_limit else "")
            key = NO_PIPELINE if row.config.pp == 1 else key
            if key not in seen:
                seen[key] = row
        return list(seen.values())
