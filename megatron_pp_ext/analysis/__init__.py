"""Pure-Python analysis of schedules: validation (dependencies, deadlock freedom) and simulation."""

from ..schedules.costs import Costs
from .simulate import DEFAULT_W_RETAINED_FRACTION, SimResult, simulate
from .validate import (
    ChannelError,
    DeadlockError,
    DependencyError,
    DuplicateOpError,
    MissingOpError,
    PlacementError,
    ScheduleValidationError,
    check_dependencies,
    check_lowered,
    check_ops,
    validate,
)

__all__ = [
    "DEFAULT_W_RETAINED_FRACTION",
    "ChannelError",
    "Costs",
    "DeadlockError",
    "DependencyError",
    "DuplicateOpError",
    "MissingOpError",
    "PlacementError",
    "ScheduleValidationError",
    "SimResult",
    "check_dependencies",
    "check_lowered",
    "check_ops",
    "simulate",
    "validate",
]
