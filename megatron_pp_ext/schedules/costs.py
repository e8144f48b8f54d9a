"""Op costs: :class:`Costs` (what users give and the simulator reads) and :class:`StageCosts`
(the same as plain per-stage tuples, what the generators time their candidates with).

``t_f``, ``t_b``, ``t_w`` (and ``t_bw``) are one number for every stage or one per global stage;
``t_comm`` is the time of one cross-rank hop (a local hand-off is free). Pure Python, no torch;
:mod:`megatron_pp_ext.analysis` re-exports :class:`Costs`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from .capabilities import ScheduleParameterError
from .values import parse_costs

__all__ = ["Cost", "Costs", "PerStage", "StageCosts", "expand_cost", "per_stage_cost", "stage_costs"]

Cost = float | tuple[float, ...]
PerStage = float | Sequence[float]


def check_cost(name: str, value: object) -> Cost:
    if isinstance(value, bool):
        raise ValueError(f"cost {name} must be a number or a per-stage sequence of numbers, got {value!r}")
    if isinstance(value, int | float):
        values: tuple[float, ...] = (float(value),)
        result: Cost = float(value)
    elif isinstance(value, Sequence) and not isinstance(value, str):
        try:
            values = tuple(float(x) for x in value)
        except (TypeError, ValueError):
            raise ValueError(f"cost {name} must be numbers, got {value!r}") from None
        if not values:
            raise ValueError(f"cost {name}: per-stage sequence is empty")
        result = values
    else:
        raise ValueError(f"cost {name} must be a number or a per-stage sequence of numbers, got {value!r}")
    for x in values:
        if not math.isfinite(x) or x < 0:
            raise ValueError(f"cost {name} must be finite and >= 0, got {x}")
    return result


@dataclass(frozen=True)
class Costs:
    """Per-op times: ``t_f``, ``t_b``, ``t_w`` (and ``t_bw``, default ``t_b + t_w``) are one
    number for every stage or a tuple indexed by global stage; ``t_comm`` is the time of one
    cross-rank hop (a local hand-off is free)."""

    t_f: Cost = 1.0
    t_b: Cost = 1.0
    t_w: Cost = 1.0
    t_bw: Cost | None = None
    t_comm: float = 0.0

    def __post_init__(self) -> None:
        for name in ("t_f", "t_b", "t_w", "t_bw"):
            value = getattr(self, name)
            if value is not None or name != "t_bw":
                object.__setattr__(self, name, check_cost(name, value))
        comm = check_cost("t_comm", self.t_comm)
        if isinstance(comm, tuple):
            raise ValueError("cost t_comm must be one number (time of one cross-rank hop)")
        object.__setattr__(self, "t_comm", comm)

    @classmethod
    def unit(cls) -> Costs:
        """``T_F = T_B = T_W = 1``, ``T_BW = 2``, no communication cost."""
        return cls(1.0, 1.0, 1.0, None, 0.0)

    @classmethod
    def parse(cls, text: str) -> Costs:
        """``"F,B,W"`` or ``"F,B,W,COMM"``, e.g. ``"1,1,1,0.05"`` (rules: :func:`.values.parse_costs`)."""
        f, b, w, comm = parse_costs(text)
        return cls(f, b, w, None, comm)

    def per_stage(self, num_stages: int) -> tuple[list[float], list[float], list[float], list[float]]:
        """``(t_f, t_b, t_w, t_bw)`` expanded to one value per global stage."""
        t_f = expand_cost("t_f", self.t_f, num_stages)
        t_b = expand_cost("t_b", self.t_b, num_stages)
        t_w = expand_cost("t_w", self.t_w, num_stages)
        t_bw = (
            [b + w for b, w in zip(t_b, t_w, strict=True)]
            if self.t_bw is None
            else expand_cost("t_bw", self.t_bw, num_stages)
        )
        return t_f, t_b, t_w, t_bw

    def __str__(self) -> str:
        def fmt(x: Cost | None) -> str:
            return "B+W" if x is None else (f"{x:g}" if isinstance(x, float) else "per-stage")

        return f"F={fmt(self.t_f)} B={fmt(self.t_b)} W={fmt(self.t_w)} BW={fmt(self.t_bw)} comm={fmt(self.t_comm)}"


def expand_cost(name: str, value: PerStage, num_stages: int) -> list[float]:
    if isinstance(value, int | float):
        return [float(value)] * num_stages
    values = [float(x) for x in value]
    if len(values) != num_stages:
        raise ValueError(f"{name} lists {len(values)} per-stage values, the schedule has {num_stages} stages")
    return values


def per_stage_cost(name: str, value: object, num_stages: int) -> tuple[float, ...]:
    """One cost (``t_f``, ``t_b``, ...) as one float per stage, from a number or a per-stage sequence."""
    if isinstance(value, bool):
        raise ScheduleParameterError(f"costs.{name} must be a number >= 0 or one per stage, got {value!r}")
    if isinstance(value, int | float):
        values: tuple[float, ...] = (float(value),) * num_stages
    elif isinstance(value, Sequence) and not isinstance(value, str):
        try:
            values = tuple(float(x) for x in value)
        except (TypeError, ValueError):
            raise ScheduleParameterError(f"costs.{name} must be numbers, got {value!r}") from None
        if len(values) != num_stages:
            raise ScheduleParameterError(
                f"costs.{name} lists {len(values)} per-stage values, the schedule has {num_stages} stages"
            )
    else:
        raise ScheduleParameterError(f"costs.{name} must be a number >= 0 or one per stage, got {value!r}")
    for x in values:
        if not (math.isfinite(x) and x >= 0):
            raise ScheduleParameterError(f"costs.{name} must be finite and >= 0, got {x}")
    return values


class StageCosts(NamedTuple):
    """Per-stage op times and the time of one cross-rank hop, as plain tuples."""

    f: tuple[float, ...]
    b: tuple[float, ...]
    w: tuple[float, ...]
    comm: float


def stage_costs(costs: object, num_stages: int) -> StageCosts:
    """Read ``t_f``, ``t_b``, ``t_w`` (a number or one per stage) and ``t_comm`` (a number) from any
    object that has them, e.g. :class:`Costs`; ``None`` = unit costs."""
    if costs is None:
        return StageCosts((1.0,) * num_stages, (1.0,) * num_stages, (1.0,) * num_stages, 0.0)
    missing = [a for a in ("t_f", "t_b", "t_w") if not hasattr(costs, a)]
    if missing:
        raise ScheduleParameterError(
            f"costs must have attributes t_f, t_b, t_w (and optionally t_comm); {type(costs).__name__} lacks "
            + ", ".join(missing)
        )
    comm = getattr(costs, "t_comm", 0.0)
    if isinstance(comm, bool) or not isinstance(comm, int | float) or not (math.isfinite(comm) and comm >= 0):
        raise ScheduleParameterError(f"costs.t_comm must be one finite number >= 0 (time of one hop), got {comm!r}")
    return StageCosts(
        per_stage_cost("t_f", costs.t_f, num_stages),  # type: ignore[attr-defined]
        per_stage_cost("t_b", costs.t_b, num_stages),  # type: ignore[attr-defined]
        per_stage_cost("t_w", costs.t_w, num_stages),  # type: ignore[attr-defined]
        float(comm),
    )
