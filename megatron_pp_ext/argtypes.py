"""argparse value types with their valid range: a bad value is one argparse error line, exit status 2.

``type=positive_int`` rejects ``0`` instead of letting ``args.x or default`` replace it; the float
types reject ``nan`` and ``inf`` (``float()`` accepts both) and name the range in the message.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from .schedules import values
from .schedules.values import MAX_VALUE

T = TypeVar("T")


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


def int_in(low: int, high: int, why: str) -> Callable[[str], int]:
    """An integer in ``[low, high]``; ``why`` says where the upper bound comes from (in the message)."""

    def parse(text: str) -> int:
        value = int(_number(text, int))
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be an integer in [{low}, {high:,}] ({why}), got {text!r}")
        return value

    parse.__name__ = f"int in [{low}, {high}]"
    return parse


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


def _shared(parse: Callable[[str], T], name: str) -> Callable[[str], T]:
    """An argparse type from a shared value parser of :mod:`.schedules.values` (its ValueError -> one argparse line)."""

    def check(text: str) -> T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    check.__name__ = name
    return check


# ``--pipeline-unit-size`` (zeropp's scheduling unit): micro-batches >= 1, or ``auto``.
unit_size = _shared(values.parse_unit_size, "unit_size")
# ``N`` or ``Np`` activations (a :class:`~.schedules.values.ActivationLimit`).
memory_limit = _shared(values.parse_memory_limit, "memory_limit")
# ``F,B,W[,COMM]`` as a tuple of four floats.
costs = _shared(values.parse_costs, "costs")
# ``PER_OP[,PER_EXCHANGE]`` host times charged by the simulator.
host_costs = _shared(values.parse_host_costs, "host_costs")
# one all-to-all's time (MoE dispatch or combine of one layer), a float >= 0.
a2a_time = _shared(values.parse_a2a_time, "a2a_time")
# ``N`` or ``N,N,...`` MoE layers per stage.
moe_layers = _shared(values.parse_moe_layers, "moe_layers")
# ``KIND=F,B,W;...`` measured per-layer times: ``({kind: (F, B, W)}, micro_batch, tp)``.
layer_costs = _shared(values.parse_layer_costs, "layer_costs")


def layout(text: str) -> str:
    """A pipeline layout (megatron's layout text), syntax checked by the shared parser and kept as written."""
    _shared(values.parse_layer_layout, "layout")(text)
    return text


def memory_limit_list(text: str) -> tuple[str, ...]:
    """Comma-separated memory limits (``p,2p,12``), each checked by the shared parser and kept as written."""
    items = tuple(x.strip() for x in str(text).split(",") if x.strip())
    for item in items:
        memory_limit(item)
    return items


def output_file(text: str) -> str:
    """A file to write (``plan --save``): checked when the command line is read, before any work, so that
    a search of minutes does not end in a traceback: its folder exists and is writable, and it is a regular file
    or none yet (not a folder, a device or a pipe). A full disk shows only when writing: the command says so then."""
    path = Path(text)
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory, not a file")
    if path.exists() and not path.is_file():
        raise argparse.ArgumentTypeError(f"{text} is not a regular file (a device or a pipe): name a file")
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: folder {folder} does not exist (create it first)")
    if not os.access(folder, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text}: not writable")
    return text


def output_dir(text: str) -> str:
    """A directory to write into, created when missing (``--out``): it must not be an existing file."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} exists and is not a directory")
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("."))
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: {existing} is a file, so the directory cannot be created")
    return text
