"""Pure-Python analysis of schedules: validation (dependencies, deadlock freedom) and simulation."""

from ..schedules.costs import Costs
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

__all__ = [
    "DEFAULT_W_RETAINED_FRACTION",
    "ChannelError",
    "CollectiveError",
    "Costs",
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
    "validate",
]
