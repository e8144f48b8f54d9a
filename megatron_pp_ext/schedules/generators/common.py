"""What the generators share, re-exported: parameter checks (:mod:`..capabilities`) and cost reading
(:mod:`..costs`)."""

from __future__ import annotations

from ..capabilities import ScheduleParameterError, check_int, reject_unsupported
from ..costs import StageCosts, per_stage_cost, stage_costs

__all__ = [
    "ScheduleParameterError",
    "StageCosts",
    "check_int",
    "per_stage_cost",
    "reject_unsupported",
    "stage_costs",
]
