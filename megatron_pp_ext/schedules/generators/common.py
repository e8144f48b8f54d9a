"""Cost reading shared by the cost-aware generators (parameter checks: :mod:`..capabilities`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

from ..capabilities import ScheduleParameterError, check_int, reject_unsupported

__all__ = [
    "ScheduleParameterError",
    "StageCosts",
    "check_int",
    "per_stage_cost",
    "reject_unsupported",
    "stage_costs",
]


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
    object that has them, e.g. :class:`megatron_pp_ext.analysis.simulate.Costs`; ``None`` = unit costs."""
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
