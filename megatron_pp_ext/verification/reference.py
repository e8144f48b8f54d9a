"""The reference runs a verification run is judged against (:mod:`.criterion` says why these two).

Both are megatron-core's own no-pipelining schedule on the unpartitioned model with the run's model,
data, seed and training: one in float64 on a single replica (the exact result) and one in fp32 with the
run's data-parallel grouping. A schedule that runs megatron's own 1F1B order is also compared with
megatron's 1F1B on the same ranks (:func:`is_megatron_1f1b`); an overlapped run of megatron's interleaved
1F1B order with megatron's interleaved combined 1F1B (:mod:`.megatron_order`).
"""

from __future__ import annotations

import copy
from typing import Any

from .rank_pool import check_errors
from .rank_run import TrainingRankPool
from .run_spec import NATIVE, RunHooks, RunSpec


def is_megatron_1f1b(schedule: Any) -> bool:
    """Whether ``schedule`` runs megatron-core's own 1F1B order (same placement, same ops on every rank)."""
    from ..schedules import generate

    try:
        megatron = generate("1f1b", schedule.num_ranks, schedule.num_microbatches)
    except ValueError:
        return False
    return schedule.placement == megatron.placement and [list(r) for r in schedule.ops] == [
        list(r) for r in megatron.ops
    ]


def reference_specs(spec: RunSpec) -> tuple[RunSpec, RunSpec]:
    """The two references of ``spec``'s run (:mod:`.criterion`): megatron's no-pipelining schedule on the
    same model, data and training, in float64 on one replica (the exact result) and in fp32 with the
    run's data-parallel grouping (``dp`` replicas, DDP or distributed optimizer as the run, and the run's
    expert parallelism; the exact one holds every expert on its one rank)."""
    common: dict[str, Any] = {
        "pp": 1,
        "mode": NATIVE,
        "tp": spec.tp,
        "model": spec.model,
        "iterations": spec.iterations,
        "use_ddp": spec.use_ddp,
        "sequence_parallel": spec.sequence_parallel,
        "timeout_s": spec.timeout_s,
        "adam_eps": spec.adam_eps,
        "lr": spec.lr,
        "device": spec.device,
        "hooks": RunHooks(stage_p2p_through_host=spec.hooks.stage_p2p_through_host),
    }
    exact = RunSpec(num_microbatches=spec.num_microbatches * spec.dp, float64=True, **common)
    reference = RunSpec(
        num_microbatches=spec.num_microbatches,
        dp=spec.dp,
        ep=spec.ep,
        distributed_optimizer=spec.distributed_optimizer,
        **common,
    )
    return exact, reference


# A reference does not depend on the schedule under test (``pp = 1``, megatron's own schedule), only on
# the model, data, training and data-parallel grouping, and a run with the same spec on the same pool
# (the same machine configuration) repeats the same operations in the same order (seeded data and
# weights, no dropout, a fixed reduction order): verifying several schedules of one shape (a sweep, a
# parametrized test) runs each reference once. The most recent ones are kept in ``pool.references``.
_KEEP = 32  # tiny models: a reference's losses and gradients are a few hundred kB


def reference_runs(
    pool: TrainingRankPool, spec: RunSpec, phase: Any = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Run :func:`reference_specs` of ``spec`` on ``pool``: ``(exact, reference)`` results, checked.
    ``phase`` (callable(text)) is told which reference is running. A reference already run in this
    pool with the same spec is not run again (``pool.references``)."""
    results = []
    names = ("exact reference (float64)", "megatron's fp32 reference")
    for name, ref_spec in zip(names, reference_specs(spec), strict=True):
        done = pool.references
        if ref_spec in done:
            done.move_to_end(ref_spec)
            results.append(copy.deepcopy(done[ref_spec]))
            continue
        if phase is not None:
            phase(name)
        results.append(pool.run(ref_spec))
        check_errors(results[-1])
        done[ref_spec] = copy.deepcopy(results[-1])
        while len(done) > _KEEP:
            done.popitem(last=False)
    return results[0], results[1]
