"""What the commands share besides their tables: the exit codes and the CLI's own list-valued flags."""

from __future__ import annotations

from .. import argtypes
from ..schedule_args import CliError

EXIT_INVALID = 1
EXIT_USAGE = 2


def step_times(text: str) -> float | list[float]:
    """``--step-time``: one time >= 0, or one per rank, comma-separated."""
    values = [argtypes.nonnegative_float(part) for part in text.split(",")]
    return values[0] if len(values) == 1 else values


def int_list(text: str) -> list[int]:
    """``bench -p/--m-factors``, ``draw --html-p/--html-m-factors``: comma-separated integers in 1..256."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(x < 1 or x > 256 for x in values):
        raise CliError(f"expected integers in 1..256, got {text!r}")
    return values
