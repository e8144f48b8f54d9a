"""Planner: grid search over TP/PP/DP/micro-batch/schedule with the simulator and a memory model;
Slurm job arrays, a log collector and a local (CPU) launcher for the planned configurations.

Pure Python (no torch) except where a launcher starts ``scripts/pretrain_gpt.py``. One module a job,
each using the others' public names only:

* the search: :mod:`.space` (``SearchSpace``, one point ``Config``), :mod:`.search` (``Planner``: the
  shapes that divide, the ranking), :mod:`.variants` (a schedule's variants at a shape, or why it does
  not apply), :mod:`.evaluate` (one candidate's memory and time; ``estimate_memory``), :mod:`.extrapolate`
  (short anchor runs extrapolated), :mod:`.memo` (``PlannerMemo``: built schedules and simulations kept
  across planners), :mod:`.schedule_cache` (slow generators' output on disk), :mod:`.layer_layouts` (the layer
  layouts a candidate tries, megatron's layout flags, a given layout's checks) and :mod:`.layout_search`
  (a candidate under those layouts);
* the models: :mod:`.models`, :mod:`.memory`, :mod:`.cost_model`, :mod:`.retiming`, :mod:`.dp_stream`,
  :mod:`.fsdp_axis`, :mod:`.layer_costs` (each layer kind's time, activations and parameters; per-stage
  costs of a layout);
* the output: :mod:`.result` (``PlanRow``, ``PlanResult``), :mod:`.megatron_args`, :mod:`.plan_report`
  (table, summary, JSON document, CSV), :mod:`.files` (input files read with a size cap), :mod:`.auto`
  (the ``--pipeline-schedule auto`` decision), :mod:`.options` (the planner's flags and the ``Planner``
  they describe);
* running the plan: :mod:`.grid` (a Slurm grid's files), :mod:`.sbatch` (its job script, from one
  template), :mod:`.driver_flags` (the driver accepts every flag), :mod:`.specs` (checked-in plan
  specifications), :mod:`.local` (runs on this machine), :mod:`.children` (child processes);
* reading the runs: :mod:`.log_parse` (one log), :mod:`.collect` (the rows, next to the plan),
  :mod:`.collect_report` (CSV, markdown), :mod:`.collect_plot`, :mod:`.paper` (the paper-style table),
  :mod:`.layout_runs` (a planned layout against the uniform split on real runs: predicted and traced busy time
  per rank, gains).

The commands (``plan``, ``grid``, ``collect``, ``launch-local``) are in :mod:`megatron_pp_ext.cli`.
"""

from .cost_model import DEVICES, CostModel, Device, LayerTimes, get_device, model_flops_per_iteration
from .memory import GIB, RankMemory, TrainingSetup, bytes_per_parameter, layer_activation_bytes, rank_memory
from .models import PRESETS, ModelSpec, get_model, model_names
from .result import PlanResult, PlanRow
from .search import Planner
from .space import Config, SearchSpace

__all__ = [
    "DEVICES",
    "GIB",
    "PRESETS",
    "Config",
    "CostModel",
    "Device",
    "LayerTimes",
    "ModelSpec",
    "PlanResult",
    "PlanRow",
    "Planner",
    "RankMemory",
    "SearchSpace",
    "TrainingSetup",
    "bytes_per_parameter",
    "get_device",
    "get_model",
    "layer_activation_bytes",
    "model_flops_per_iteration",
    "model_names",
    "rank_memory",
]
