"""What the executor precomputes once per (schedule, rank, collective policy): the rank's program and its
collectives (:class:`RunPlan`), cached per forward-backward function (:class:`PlanCache`).

Nothing here is schedule-specific: a plan is read off the schedule's op lists, its placement and the lowering.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..analysis.overlap_order import overlap_order
from ..schedules.collectives import Collective, CollectivePolicy, derive_collectives, fsdp_policy
from ..schedules.ir import Op, OpKind
from ..schedules.lowering import Compute, Exchange, LoweredSchedule, lower
from ..schedules.schedule import Schedule
from .errors import ExecutorError
from .grad_sync import grad_sync_funcs

ScheduleSource = Callable[[int], Schedule]
logger = logging.getLogger(__name__)


def forward_only_schedule(schedule: Schedule) -> Schedule:
    """The forward ops of ``schedule`` in the same per-rank order (evaluation)."""
    ops = tuple(tuple(op for op in row if op.kind == OpKind.F) for row in schedule.ops)
    return Schedule(
        placement=schedule.placement,
        num_microbatches=schedule.num_microbatches,
        ops=ops,
        name=f"{schedule.name}[forward-only]",
        microbatch_replicas=schedule.microbatch_replicas,
    )


@dataclass(frozen=True)
class RunPlan:
    """What the executor precomputes once per (schedule, rank)."""

    lowered: LoweredSchedule
    program: tuple[Compute | Exchange, ...]
    first_forward: frozenset[Op]  # first F of each local chunk
    collectives: dict[int, tuple[Collective, ...]]  # gap (index of the next compute op) -> collectives
    # (stage, micro-batch) of every forward or backward of the rank inside an overlap pair: with megatron's
    # combined step those run as schedule plans (a forward built as one is differentiated by one); the others
    # run megatron's plain forward_step / backward_step, all-to-alls inline
    paired: frozenset[tuple[int, int]] = frozenset()


def plan_for(lowered: LoweredSchedule, rank: int, policy: CollectivePolicy, prefetch: bool) -> RunPlan:
    """Rank ``rank``'s program of ``lowered`` and the collectives ``policy`` places in its gaps."""
    placement = lowered.schedule.placement
    program = lowered.program(rank, prefetch)
    collectives = derive_collectives(lowered.schedule, policy).on_rank(rank)
    first_forward: dict[int, Op] = {}
    for ins in program:
        if isinstance(ins, Compute) and ins.op.kind == OpKind.F:
            first_forward.setdefault(placement.chunk_of(ins.op.stage), ins.op)
    row = lowered.schedule.ops[rank]
    starts = lowered.schedule.overlap_pairs[rank] if lowered.schedule.overlap_pairs else ()
    paired = frozenset((row[j].stage, row[j].microbatch) for i in starts for j in (i, i + 1))
    return RunPlan(lowered, program, frozenset(first_forward.values()), collectives, paired)


def next_op(program: Sequence[Compute | Exchange], index: int) -> Op | None:
    """The first compute op after ``program[index]`` (None after the last one)."""
    for ins in program[index + 1 :]:
        if isinstance(ins, Compute):
            return ins.op
    return None


class PlanCache:
    """The plans of one forward-backward function, keyed by the call's shape and collective policy.

    ``fsdp_max_unsharded`` / ``fsdp_grad_reduce_unit`` / ``replica_sync``: as
    :func:`~megatron_pp_ext.runtime.executor.make_forward_backward_func` takes them.
    """

    def __init__(
        self,
        schedule_for: ScheduleSource,
        fsdp_max_unsharded: int | None,
        fsdp_grad_reduce_unit: int | None,
        replica_sync: Any,
    ) -> None:
        self.schedule_for = schedule_for
        self.fsdp_max_unsharded = fsdp_max_unsharded
        self.fsdp_grad_reduce_unit = fsdp_grad_reduce_unit
        self.replica_sync = replica_sync
        self.plans: dict[tuple[int, int, bool, CollectivePolicy, bool, bool], tuple[Schedule, RunPlan]] = {}

    def policy(self, schedule: Schedule, forward_only: bool, config: Any, models: list[Any]) -> CollectivePolicy:
        """Which collectives a call places: gradient reduction, parameter sync, replica sync, FSDP gathers."""
        training = not forward_only
        fields = {
            "reduce_grads": training and grad_sync_funcs(config, models) is not None,
            "param_sync": training and config.param_sync_func is not None,
            "replica_sync": training and self.replica_sync is not None,
        }
        if self.fsdp_max_unsharded is not None or (models and all(hasattr(m, "unshard") for m in models)):
            # FSDP chunks: the schedule's declared gather limit and gradient reduction unit unless given
            return fsdp_policy(schedule, self.fsdp_max_unsharded, self.fsdp_grad_reduce_unit, **fields)
        return CollectivePolicy(**fields)

    def plan(
        self,
        num_microbatches: int,
        rank: int,
        forward_only: bool,
        config: Any,
        models: list[Any],
        prefetch: bool,
        combined: bool,
    ) -> RunPlan:
        """The plan of one call (made again when the source hands out another schedule)."""
        schedule = self.schedule_for(num_microbatches)  # the source caches; it may re-plan between calls
        policy = self.policy(schedule, forward_only, config, models)
        key = (num_microbatches, rank, forward_only, policy, prefetch, combined)
        cached = self.plans.get(key)
        if cached is None or cached[0] is not schedule:
            if schedule.num_microbatches != num_microbatches:
                raise ExecutorError(
                    f"schedule {schedule.name!r} is for {schedule.num_microbatches} micro-batches, "
                    f"megatron asked for {num_microbatches}"
                )
            run_schedule = forward_only_schedule(schedule) if forward_only else schedule
            if combined:
                run_schedule = overlap_order(run_schedule)
                if rank == 0 and "pair_lags" in run_schedule.params:
                    logger.info(
                        "--overlap-moe-expert-parallel-comm: %s runs each rank's backwards %s forwards later than "
                        "generated (per rank) so that every overlapped pair's inputs come from an earlier step; "
                        "each rank holds that many more micro-batches' activations",
                        schedule.name,
                        run_schedule.params["pair_lags"],
                    )
            self.plans[key] = cached = (schedule, plan_for(lower(run_schedule), rank, policy, prefetch))
        return cached[1]
