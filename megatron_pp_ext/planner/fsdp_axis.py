"""FSDP inside the pipeline as a planner axis: which candidates may shard, and what sharding costs.

A candidate runs with FSDP (``--pipeline-fsdp``) only when its schedule declares it can
(``Capabilities.data_parallel.fsdp``: ``optional`` or ``required``) and the runtime covers the
shape: data-parallel size >= 2, TP = 1 and untied embeddings, as
:mod:`megatron_pp_ext.integration.fsdp_training` refuses the rest (it also trains fp32 only for now;
the planner still models the precision asked for, see :data:`RUNTIME_NOTE`).

Memory: :func:`~megatron_pp_ext.planner.memory.fsdp_rank_memory` over the collective plan the
lowering derives with the schedule's declared gathered-chunk limit
(:func:`~megatron_pp_ext.schedules.collectives.policy_for`). Time: the simulator with its per-rank
data-parallel stream (:func:`~megatron_pp_ext.analysis.simulate.simulate` with ``collectives``,
``dp``, ``dp_bandwidth``, ``param_bytes``): every FSDP all-gather before a chunk's use and every
gradient reduce-scatter after its last gradient op, a ring over ``d`` ranks moving a chunk's
parameters (``param_bytes`` per parameter); the iteration ends when every rank's stream drained.
Simulations are cached by costs and collective times normalised by the largest forward time
(3 significant digits), like the planner's own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..analysis.simulate import simulate
from ..schedules import registry
from ..schedules.collectives import CollectiveKind, CollectivePlan, derive_collectives, policy_for
from ..schedules.costs import Costs
from ..schedules.lowering import LoweredSchedule
from ..schedules.schedule import Schedule
from .memo import normalise, round_sig
from .models import ModelSpec

__all__ = ["RUNTIME_NOTE", "FsdpSimulator", "FsdpTiming", "fsdp_options", "fsdp_refusal"]

RUNTIME_NOTE = (
    "fsdp rows: --pipeline-fsdp (per-chunk FSDP driven by the schedule); its runtime trains fp32 only for now, "
    "other precisions are a model of the costs"
)


def fsdp_refusal(name: str, tensor_parallel: int, data_parallel: int, model: ModelSpec) -> str | None:
    """Why schedule ``name`` cannot run this shape with FSDP, or ``None`` when it can."""
    caps = registry.get(name).capabilities
    if caps is None or caps.data_parallel.fsdp == "no":
        return f"{name} does not shard parameters (FSDP) inside the pipeline"
    if data_parallel < 2:
        return "FSDP needs a data-parallel size >= 2"
    if tensor_parallel > 1:
        return "--pipeline-fsdp runs with TP=1 only"
    if not model.untie_embeddings_and_output_weights:
        return "tied embeddings are not supported under --pipeline-fsdp (untie them)"
    return None


def fsdp_options(
    name: str, tensor_parallel: int, data_parallel: int, model: ModelSpec, wanted: Sequence[bool]
) -> list[bool] | str:
    """The FSDP settings of ``wanted`` this candidate can run, or why none."""
    caps = registry.get(name).capabilities
    required = caps is not None and caps.data_parallel.fsdp == "required"
    refusal = fsdp_refusal(name, tensor_parallel, data_parallel, model)
    out = [f for f in dict.fromkeys(wanted) if (not f or refusal is None) and (f or not required)]
    if out:
        return out
    return refusal if refusal is not None else f"{name} needs FSDP (sharded parameters) inside the pipeline"


@dataclass(frozen=True)
class FsdpTiming:
    iteration: float  # seconds: compute, gather stalls and the streams' drain
    gathers: int  # FSDP all-gathers per iteration on the rank that issues the most


class FsdpSimulator:
    """Collective plans and data-parallel-stream simulations of FSDP candidates, cached."""

    def __init__(self) -> None:
        self._plans: dict[Any, CollectivePlan] = {}
        self._times: dict[Any, FsdpTiming] = {}
        self.simulations = 0

    def plan(self, key: Any, schedule: Schedule) -> CollectivePlan:
        """The FSDP collective plan of ``schedule`` (its declared gathered-chunk limit)."""
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = derive_collectives(schedule, policy_for(schedule, fsdp=True))
        return plan

    def time(
        self,
        key: Any,
        schedule: Schedule,
        lowered: LoweredSchedule,
        costs: Costs,
        stage_bytes: Sequence[float],
        data_parallel: int,
        bandwidth: float,
    ) -> FsdpTiming:
        """Iteration time (seconds) of ``schedule`` at ``costs`` (seconds) with FSDP over
        ``data_parallel`` ranks at ``bandwidth`` bytes/s, chunk ``s`` moving ``stage_bytes[s]``."""
        scale, norm = normalise(costs, schedule.num_stages)
        sizes = tuple(round_sig(x / (bandwidth * scale)) for x in stage_bytes)
        skey = (key, norm, sizes, int(data_parallel))
        hit = self._times.get(skey)
        if hit is None:
            result = simulate(
                schedule,
                Costs(norm[0], norm[1], norm[2], None, norm[3]),
                lowered=lowered,
                collectives=policy_for(schedule, fsdp=True),
                dp=int(data_parallel),
                dp_bandwidth=1.0,
                param_bytes=list(sizes),
            )
            data = result.data_parallel
            assert data is not None
            gathers = max((data.plan.count(CollectiveKind.UNSHARD, r) for r in range(schedule.num_ranks)), default=0)
            hit = self._times[skey] = FsdpTiming(data.iteration_time, gathers)
            self.simulations += 1
        return FsdpTiming(hit.iteration * scale, hit.gathers)
