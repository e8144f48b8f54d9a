"""``auto``: pick the fastest schedule that fits the memory budget.

The same logic behind ``megatron-pp plan --schedules auto`` and ``--pipeline-schedule auto``: the
:class:`~.search.Planner` evaluates every registered schedule with every parameter it takes (chunks per
rank for loop placements, the memory limits :data:`AUTO_MEMORY_LIMITS` for memory-aware schedules, the
costs for cost-aware ones) with the simulator and the memory model, drops what does not fit the budget
and ranks the rest by estimated iteration time; ``auto`` takes the first. :class:`AutoDecision` prints
the decision table: the top candidates with their time, bubble and memory, and why the others were
dropped (over the budget, with the least memory any of their configurations needs, or not applicable,
with the generator's reason).

Pure planning: a training run's planner (from megatron's args, the GPU's memory) is built by
:mod:`megatron_pp_ext.integration.auto_schedule`, which also decides again from measured costs
(``--pipeline-replan``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .memory import GIB
from .plan_report import format_table, row_label
from .result import PlanResult, PlanRow
from .search import Planner
from .space import SearchSpace

__all__ = ["AUTO", "AUTO_MEMORY_LIMITS", "AutoDecision", "auto_space", "decide"]

AUTO = "auto"
AUTO_MEMORY_LIMITS = ("p", "2p")  # memory limits tried for memory-aware schedules (besides their default)


def auto_space(space: SearchSpace) -> SearchSpace:
    """``space`` with every registered schedule and the auto memory limits added to its own, FSDP
    on and off (unless ``space`` fixes it: a training run's ``--pipeline-fsdp``) and, for zeropp,
    every unit size the space allows (default: every divisor of m)."""
    limits = tuple(dict.fromkeys((*space.memory_limits, *AUTO_MEMORY_LIMITS)))
    fsdp = space.fsdp if space.fsdp is not None else (False, True)
    return replace(space, schedules=None, memory_limits=limits, fsdp=fsdp)


@dataclass
class AutoDecision:
    result: PlanResult
    overlap: float = 0.0  # the planner's overlap factor of forward-and-backward pairs

    @property
    def chosen(self) -> PlanRow | None:
        return self.result.rows[0] if self.result.rows else None

    def table(self, top: int = 8) -> str:
        """The decision table (printed on rank 0)."""
        result, chosen = self.result, self.chosen
        budget = result.budget_bytes / GIB
        if chosen is None:
            lines = [f"pipeline schedule auto: nothing fits in {budget:.2f} GiB"]
        else:
            c = chosen.config
            extra = (f", U={c.unit_size}" if c.unit_size is not None else "") + (", FSDP" if c.fsdp else "")
            lines = [
                f"pipeline schedule auto: {_label(chosen)} (v={c.chunks}{extra}, {c.placement} placement): iteration "
                f"{chosen.iteration_time * 1e3:.3g} ms, bubble {chosen.sync_bubble_rate:.3f}, peak "
                f"{chosen.peak_memory / GIB:.2f} of {budget:.2f} GiB; {result.evaluated} candidates simulated"
                + (f"; overlap pairs timed with overlap F={self.overlap:g}" if self.overlap else "")
            ]
        header = ["#", "schedule", "v", "fsdp", "iteration ms", "pipeline ms", "DP exposed ms", "gathers"]
        header += ["bubble", "sync bubble", "peak GiB"]
        rows = [
            [
                str(i),
                row_label(row.config),
                str(row.config.chunks),
                "fsdp" if row.config.fsdp else "-",
                f"{row.iteration_time * 1e3:.4g}",
                f"{row.pipeline_time * 1e3:.4g}",
                f"{row.dp_time * 1e3:.3g}",
                str(row.gathers) if row.config.fsdp else "-",
                f"{row.bubble_rate:.4f}",
                f"{row.sync_bubble_rate:.4f}",
                f"{row.peak_memory / GIB:.3f}",
            ]
            for i, row in enumerate(_alternatives(result.rows)[:top], 1)
        ]
        if rows:
            lines.append(format_table(header, rows))
        fitting = {_label(row) for row in result.rows}
        for label, peak in sorted(result.over_budget_best.items()):
            if label not in fitting:
                lines.append(f"  dropped {label}: over budget (needs {peak / GIB:.3f} GiB > {budget:.3f})")
        for name, reasons in sorted(result.inapplicable.items()):
            if not any(label.split("@")[0] == name for label in fitting):
                why, _ = reasons.most_common(1)[0]
                lines.append(f"  dropped {name}: not applicable: {why}")
        return "\n".join(lines)


def _label(row: PlanRow) -> str:
    c = row.config
    return c.schedule + (f"@{c.memory_limit}" if c.memory_limit else "")


def _alternatives(rows: list[PlanRow]) -> list[PlanRow]:
    """The best row of each schedule, memory limit, unit size and FSDP setting, best first."""
    seen: dict[tuple[str, bool], PlanRow] = {}
    for row in rows:
        seen.setdefault((row_label(row.config), row.config.fsdp), row)
    return list(seen.values())


def decide(planner: Planner, names: tuple[str, ...] | None = None) -> AutoDecision:
    """Run ``planner`` over every schedule (or those ``names``) with every parameter (see :func:`auto_space`)
    and keep its ranking."""
    planner.space = auto_space(planner.space)
    planner.schedule_names = tuple(sorted(names if names is not None else _registered()))
    return AutoDecision(planner.run(progress=False), planner.overlap)


def _registered() -> list[str]:
    from ..schedules import registry

    return [registry.get(name).name for name in registry.names()]
