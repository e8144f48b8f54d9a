"""Parameter checks shared by the generators."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from ..ir import ScheduleError


class ScheduleParameterError(ScheduleError):
    """Parameters a schedule cannot be built for (names the parameter and the valid range)."""


def check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScheduleParameterError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ScheduleParameterError(f"{name} must be >= {minimum}, got {value}")
    return value


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


def reject_unsupported(schedule: str, unused: Mapping[str, object]) -> None:
    """Raise if a keyword the schedule does not take was given a value (not ``None``)."""
    given = sorted(k for k, value in unused.items() if value is not None)
    if given:
        raise ScheduleParameterError(
            f"{schedule} does not take parameter(s) {', '.join(given)} "
            f"(got {', '.join(f'{k}={unused[k]!r}' for k in given)})"
        )
