"""Grid search over (TP, PP, DP, micro-batch size, virtual stages, schedule, recompute): the public entry.

For a model, a GPU count and a global batch, :class:`Planner` enumerates every configuration whose shapes
divide, builds each registered schedule at it, computes every rank's memory (:mod:`.memory`) and drops
configurations over the budget, then simulates the schedule with per-stage costs (:mod:`.costs`) and ranks
the rest by estimated throughput. This module re-exports the planner's parts, each in a module of its own:

* :mod:`.space`: the search space and one point of it (``SearchSpace``, ``Config``);
* :mod:`.search`: the enumeration and ranking (``Planner``);
* :mod:`.variants`: a schedule's variants at a shape (chunk counts, memory limits, unit sizes);
* :mod:`.evaluate`: one candidate's memory and time (``estimate_memory`` for one configuration);
* :mod:`.extrapolate`: extrapolation from short anchor runs (``EXACT_MIN``, ``EXACT_FALLBACK``);
* :mod:`.memo`: built schedules and simulations kept across planners (``PlannerMemo``);
* :mod:`.schedule_cache`: slow generators' output on disk (``ScheduleCache``);
* :mod:`.result`: the rows and the search's outcome (``PlanRow``, ``PlanResult``);
* :mod:`.megatron_args`: a configuration's Megatron flags (``config_args``);
* :mod:`.report`: the table, summary, JSON document and CSV;
* :mod:`.plan_cli`: the ``plan`` command and the flags it shares with ``grid`` and ``launch-local``.
"""

from __future__ import annotations

from .evaluate import estimate_memory
from .extrapolate import EXACT_FALLBACK, EXACT_MIN
from .megatron_args import config_args, model_args, precision_args
from .memo import COMPILE_AFTER, POST_VALIDATION_ITERATIONS, SIM_COMM, SIM_KWARGS, SIM_OVERLAP, PlannerMemo
from .plan_cli import add_parser, add_plan_arguments, cmd_plan, planner_from_args, print_models
from .report import TABLE_HEADER, format_table, plan_document, row_label, select_rows, summary_lines, table_rows
from .result import PlanResult, PlanRow
from .schedule_cache import DISK_CACHE_MIN_SECONDS, ScheduleCache, default_cache_dir
from .search import Planner, Progress
from .space import NO_PIPELINE, Config, SearchSpace, default_schedules, divisors

__all__ = [
    "COMPILE_AFTER",
    "DISK_CACHE_MIN_SECONDS",
    "EXACT_FALLBACK",
    "EXACT_MIN",
    "NO_PIPELINE",
    "POST_VALIDATION_ITERATIONS",
    "SIM_COMM",
    "SIM_KWARGS",
    "SIM_OVERLAP",
    "TABLE_HEADER",
    "Config",
    "PlanResult",
    "PlanRow",
    "Planner",
    "PlannerMemo",
    "Progress",
    "ScheduleCache",
    "SearchSpace",
    "add_parser",
    "add_plan_arguments",
    "cmd_plan",
    "config_args",
    "default_cache_dir",
    "default_schedules",
    "divisors",
    "estimate_memory",
    "format_table",
    "model_args",
    "plan_document",
    "planner_from_args",
    "precision_args",
    "print_models",
    "row_label",
    "select_rows",
    "summary_lines",
    "table_rows",
]
