"""Pure-Python schedule IR and generators (no torch)."""

from .capabilities import Capabilities, ScheduleParameterError
from .costs import Costs, StageCosts, stage_costs
from .ir import BW, B, F, Op, OpKind, ScheduleError, ScheduleSyntaxError, W
from .lowering import Compute, Exchange, LoweredSchedule, Message, lower
from .placement import Placement, bidirectional_placement, loop_placement, make_placement, v_placement
from .registry import ScheduleInfo, UnknownScheduleError, generate, get, names, register
from .schedule import Schedule, build_schedule

__all__ = [
    "BW",
    "B",
    "Capabilities",
    "Compute",
    "Costs",
    "Exchange",
    "F",
    "LoweredSchedule",
    "Message",
    "Op",
    "OpKind",
    "Placement",
    "Schedule",
    "ScheduleError",
    "ScheduleInfo",
    "ScheduleParameterError",
    "ScheduleSyntaxError",
    "StageCosts",
    "UnknownScheduleError",
    "W",
    "bidirectional_placement",
    "build_schedule",
    "generate",
    "get",
    "loop_placement",
    "lower",
    "make_placement",
    "names",
    "register",
    "stage_costs",
    "v_placement",
]
