"""Schedules registered by name; lookup is case-insensitive."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .gc_pause import cyclic_gc_paused
from .ir import ScheduleError
from .schedule import Schedule

Generator = Callable[..., Schedule]


class UnknownScheduleError(ScheduleError):
    """A schedule name that is not registered."""


@dataclass(frozen=True)
class ScheduleInfo:
    name: str
    generate: Generator
    placement: str  # loop | v | bidirectional
    splits_backward: bool  # uses B/W ops (needs the weight-gradient store)
    constraints: str
    description: str
    family: str = "baseline"


_REGISTRY: dict[str, ScheduleInfo] = {}


def register(info: ScheduleInfo) -> ScheduleInfo:
    _REGISTRY[info.name.lower()] = info
    return info


def _ensure_loaded() -> None:
    from . import generators  # noqa: F401  (registers the built-in schedules)


def names() -> list[str]:
    _ensure_loaded()
    return sorted(_REGISTRY)


def get(name: str) -> ScheduleInfo:
    _ensure_loaded()
    info = _REGISTRY.get(str(name).strip().lower())
    if info is None:
        raise UnknownScheduleError(f"unknown pipeline schedule {name!r}; valid schedules: {', '.join(names())}")
    return info


def generate(name: str, p: int, m: int, **kwargs: object) -> Schedule:
    """Build schedule ``name`` for ``p`` ranks and ``m`` micro-batches."""
    info = get(name)
    with cyclic_gc_paused():
        return info.generate(p, m, **kwargs)
