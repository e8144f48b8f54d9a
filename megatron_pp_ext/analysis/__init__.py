"""Pure-Python analysis of schedules: validation (dependencies, deadlock freedom) and simulation.

Importing this package registers what the schedule registry cannot decide itself: zeropp's automatic unit
size (:mod:`.zeropp_auto`), so that ``registry.generate("zeropp", ..., unit_size="auto")`` builds it."""

from .schedule_check import (
    ChannelError,
    CollectiveError,
    DeadlockError,
    DependencyError,
    DuplicateOpError,
    MissingOpError,
    PlacementError,
    ScheduleValidationError,
    check_collective_plan,
    check_dependencies,
    check_lowered,
    check_ops,
    validate,
)
from .simulate import DEFAULT_W_RETAINED_FRACTION, DataParallelResult, SimResult, simulate
from .zeropp_auto import unit_size_context  # registers zeropp's unit_size="auto" with the schedule registry

__all__ = [
    "DEFAULT_W_RETAINED_FRACTION",
    "ChannelError",
    "CollectiveError",
    "DataParallelResult",
    "DeadlockError",
    "DependencyError",
    "DuplicateOpError",
    "MissingOpError",
    "PlacementError",
    "ScheduleValidationError",
    "SimResult",
    "check_collective_plan",
    "check_dependencies",
    "check_lowered",
    "check_ops",
    "simulate",
    "unit_size_context",
    "validate",
]
