"""Planner: grid search over TP/PP/DP/micro-batch/schedule with the simulator and a memory model;
Slurm job arrays, a log collector and a local (CPU) launcher for the planned configurations.

Pure Python (no torch) except where a launcher starts ``scripts/pretrain_gpt.py``.
"""

from .costs import DEVICES, CostModel, Device, LayerTimes, get_device, model_flops_per_iteration
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
