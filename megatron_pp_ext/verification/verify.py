"""``megatron-pp verify``'s driver: run a schedule on real gloo ranks and compare it with its references.

:func:`verify_schedule` runs the references (:mod:`.reference`) and the schedule (one
:class:`~.run_spec.RunSpec`, executed on every rank by :mod:`.rank_run`) on a
:class:`~.rank_run.TrainingRankPool`, then compares them (:mod:`.compare`, judged by :mod:`.criterion`) into a
:class:`~.verify_report.VerifyReport`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from . import criterion
from .compare import check_bitwise, check_fsdp_collectives, compare
from .megatron_order import is_megatron_interleaved
from .moe_check import moe_problem
from .rank_pool import check_errors
from .rank_run import TrainingRankPool
from .reference import is_megatron_1f1b, reference_runs
from .run_spec import NATIVE, OURS, RunHooks, RunSpec
from .tiny_gpt import TinyGPTSpec
from .verify_report import VerifyReport

__all__ = ["check_moe", "verify_schedule"]


def check_moe(model: TinyGPTSpec, ep: int, dp: int, tp: int = 1, fsdp: bool = False) -> None:
    """Refuse (ValueError, one line naming the options) an expert-parallel request megatron cannot build."""
    problem = moe_problem(model.num_experts, model.moe_topk, ep, dp, tp, fsdp)
    if problem:
        raise ValueError(problem)


def verify_schedule(
    schedule: Any,
    pool: TrainingRankPool | None = None,
    *,
    model: TinyGPTSpec | None = None,
    tp: int = 1,
    iterations: int = 3,
    trace: bool = True,
    use_ddp: bool = True,
    sequence_parallel: bool = False,
    timeout_s: float = 60.0,
    tol: float | None = None,
    p2p_tags: bool = True,
    dp: int = 1,
    ep: int = 1,
    overlap_moe: bool = False,
    distributed_optimizer: bool = False,
    fsdp: bool = False,
    fsdp_max_unsharded: int = 1,
    fsdp_grad_reduce_unit: int | None = None,
    lr: float | None = None,
    progress: Any = None,
    device: str = "cpu",
    hooks: RunHooks | None = None,
) -> VerifyReport:
    """Run ``schedule`` (a validated Schedule) and its references; return the comparison.
    ``progress`` (callable(text)) gets the steps as they happen: ranks started, iterations, comparison.

    Three runs on the same model, data and initial weights (:mod:`.criterion` says why): megatron's own
    no-pipelining schedule in float64 (the exact result) and in fp32 with the run's data-parallel
    grouping (``dp`` replicas, megatron's DDP or distributed optimizer), then the schedule on
    ``p x tp x dp`` ranks, each replica on its share of ``dp x m`` micro-batches; a schedule running
    megatron's own 1F1B order is also run by megatron's 1F1B on the same ranks and must equal it bit for
    bit. Adam with ``criterion.ADAM_EPS`` at ``criterion.LR`` (``lr`` overrides the rate). ``tol``: a fixed
    bound on the largest relative gradient difference to the fp32 reference instead of the derived verdict.
    ``fsdp_grad_reduce_unit``: with ``fsdp``, reduce each chunk's gradients once per that many
    micro-batches (default: the schedule's declared unit, e.g. ZeroPP's U; else once per iteration).
    ``hooks``: testing aids for the schedule's run (:class:`~.run_spec.RunHooks`), e.g. deliberate faults
    (:mod:`.breaks`; tests of the verdict's sharpness).

    ``ep``: with a MoE ``model`` (``num_experts``), the experts split over ``ep`` of the ``dp`` data-parallel
    ranks (:func:`check_moe` says what is accepted). ``overlap_moe``: our run puts every forward, backward
    and overlap pair through megatron's combined forward-backward step (the references do not).

    ``device`` (:class:`RunSpec`): ``"cuda"`` runs every rank on GPU 0 (p2p staged through host memory);
    a pool's processes keep the device of their first run, so give a ``"cuda"`` run a pool of its own.
    Long because its signature and docstring list every option of a verify run; the body is three named steps.
    """
    p, m = schedule.num_ranks, schedule.num_microbatches
    model, fsdp_grad_reduce_unit = _checked_request(
        schedule, model, tp, dp, ep, distributed_optimizer, fsdp, fsdp_max_unsharded, fsdp_grad_reduce_unit
    )
    ours = RunSpec(
        pp=p,
        num_microbatches=m,
        dp=dp,
        ep=ep,
        overlap_moe=overlap_moe,
        record_combined_steps=overlap_moe and not fsdp and is_megatron_interleaved(schedule),
        distributed_optimizer=distributed_optimizer,
        fsdp=fsdp,
        fsdp_max_unsharded=fsdp_max_unsharded,
        fsdp_grad_reduce_unit=fsdp_grad_reduce_unit,
        mode=OURS,
        schedule_csv=schedule.to_csv(),
        trace=trace,
        split_backward=schedule.splits_backward,
        p2p_tags=p2p_tags,
        hooks=hooks or RunHooks(),
        tp=tp,
        model=model,
        iterations=iterations,
        use_ddp=use_ddp,
        sequence_parallel=sequence_parallel,
        timeout_s=timeout_s,
        device=device,
        adam_eps=criterion.ADAM_EPS,
        lr=criterion.LR if lr is None else lr,
    )
    say = progress or (lambda text: None)
    exact, ref, run, native = _run_all(schedule, ours, pool, say, bool(progress))
    say("comparing losses and every gradient with the references")
    report = compare(schedule.name, p, m, schedule.chunks_per_rank, ref, run, tol, exact)
    if native is not None:
        check_bitwise(report, native, run, combined=ours.record_combined_steps)
    if fsdp:
        check_fsdp_collectives(report, schedule, run, fsdp_max_unsharded, fsdp_grad_reduce_unit)
    return report


def _checked_request(
    schedule: Any,
    model: TinyGPTSpec | None,
    tp: int,
    dp: int,
    ep: int,
    distributed_optimizer: bool,
    fsdp: bool,
    fsdp_max_unsharded: int,
    fsdp_grad_reduce_unit: int | None,
) -> tuple[TinyGPTSpec, int | None]:
    """Refuse what cannot run (ValueError) and resolve the model (default: one layer a stage) and the FSDP
    gradient reduction unit (the ranks get the schedule as CSV, without its declarations)."""
    if fsdp and distributed_optimizer:
        raise ValueError("--fsdp shards gradients and optimizer state itself: drop --distributed-optimizer")
    if fsdp and (model is None or model.tied_embeddings):
        raise ValueError("--fsdp supports untied embeddings only for now (add --untied-embeddings)")
    from ..analysis.schedule_check import validate

    validate(schedule)
    if fsdp:  # the ranks get the schedule as CSV, without its declarations: pass the policy explicitly
        from ..schedules.collectives import policy_for

        resolved = policy_for(
            schedule, fsdp=True, fsdp_max_unsharded=fsdp_max_unsharded, grad_reduce_unit=fsdp_grad_reduce_unit
        ).grad_reduce_unit
        fsdp_grad_reduce_unit = resolved or schedule.num_microbatches  # once per iteration, whatever is declared
    if model is None:
        model = TinyGPTSpec(num_layers=schedule.placement.stages_per_replica)
    check_moe(model, ep, dp, tp, fsdp)
    return model, fsdp_grad_reduce_unit


def _run_all(
    schedule: Any, ours: RunSpec, pool: TrainingRankPool | None, say: Any, forward_progress: bool
) -> tuple[Any, Any, Any, Any]:
    """The references, our run and (for megatron's own 1F1B order) megatron's 1F1B on the same ranks:
    ``(exact, ref, ours, native or None)``. A pool not given is started here and closed after."""
    ranks = ours.pp * ours.tp * ours.dp
    own_pool = pool is None
    if own_pool:
        say(f"starting {ranks} rank process(es) (imports take ~10 s per process)")
    pool = pool or TrainingRankPool(ranks)
    saved = pool.on_progress
    phase = [""]
    pool.on_progress = lambda text: say(f"{phase[0]}: {text}") if forward_progress else None
    try:
        exact, ref = reference_runs(pool, ours, lambda text: phase.__setitem__(0, text))
        phase[0] = f"{schedule.name} on {ranks} ranks"
        run = pool.run(ours)
        check_errors(run)
        native = None
        # the same arithmetic as megatron's 1F1B, or with overlap its interleaved combined 1F1B: bit for bit
        if not ours.fsdp and (is_megatron_1f1b(schedule) or ours.record_combined_steps):
            own = "interleaved combined 1F1B" if ours.record_combined_steps else "own 1F1B"
            phase[0] = f"megatron's {own} on {ranks} ranks"
            no_breaks = dataclasses.replace(ours.hooks, breaks=())
            native = pool.run(
                dataclasses.replace(ours, mode=NATIVE, trace=False, split_backward=False, hooks=no_breaks)
            )
            check_errors(native)
    finally:
        pool.on_progress = saved
        if own_pool:
            pool.close()
    return exact, ref, run, native
