"""argparse value types with their valid range: a bad value is one argparse error line, exit status 2.

``type=positive_int`` rejects ``0`` instead of letting ``args.x or default`` replace it; the float
types reject ``nan`` and ``inf`` (``float()`` accepts both) and name the range in the message.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

# The largest cost, time or size a command takes: far beyond any real value, small enough that sums
# and products over a whole schedule stay finite (1e308 overflowed to inf and raised a traceback).
MAX_VALUE = 1e12


def _number(text: str, kind: type) -> float:
    try:
        return kind(text)
    except (TypeError, ValueError):
        raise argparse.ArgumentTypeError(
            f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
        ) from None


def int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(_number(text, int))
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value

    parse.__name__ = f"int>={low}"
    return parse


positive_int = int_at_least(1)
nonnegative_int = int_at_least(0)


def float_in(low: float, high: float, *, low_open: bool = False) -> Callable[[str], float]:
    """A finite float in ``[low, high]`` (``(low, high]`` with ``low_open``)."""
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"

    def parse(text: str) -> float:
        value = _number(text, float)
        if not math.isfinite(value) or value > high or value < low or (low_open and value == low):
            raise argparse.ArgumentTypeError(f"must be a finite number in {interval}, got {text!r}")
        return value

    parse.__name__ = f"float in {interval}"
    return parse


positive_float = float_in(0.0, MAX_VALUE, low_open=True)
nonnegative_float = float_in(0.0, MAX_VALUE)
fraction = float_in(0.0, 1.0)  # a share, 0..1
positive_fraction = float_in(0.0, 1.0, low_open=True)


def unit_size(text: str) -> int | str:
    """``--pipeline-unit-size`` (zeropp's scheduling unit): a number of micro-batches >= 1, or ``auto``."""
    if str(text).strip().lower() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of micro-batches >= 1 or 'auto', got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 or 'auto', got {value}")
    return value
