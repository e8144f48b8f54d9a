"""``megatron-pp verify``: run a schedule on real gloo ranks and compare with a reference.

A run spawns ranks on this machine (a :class:`~.rank_pool.RankPool`, reusable across
runs), builds a tiny GPTModel split by the schedule's placement, trains a few
iterations and records every loss and every parameter gradient. The references are
the same model, unpartitioned, trained by megatron-core's own no-pipelining schedule
with the same seed and data, in float64 and in fp32; :mod:`.criterion` says how the
run is judged against them and :mod:`.compare` writes the report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import math
import time
from dataclasses import dataclass, field
from typing import Any

from . import criterion, rank_pool
from .ab_timing import AB, NATIVE, OURS, ab_timing
from .compare import VerifyReport, VerifyRunError, _check_errors, _check_fsdp_collectives, check_bitwise, compare
from .rank_pool import report_progress
from .saved_bytes import SavedBytesMeter
from .tiny_gpt import TinyGPTSpec

__all__ = [
    "AB",
    "NATIVE",
    "OURS",
    "RankPool",
    "RunSpec",
    "SavedBytesMeter",
    "VerifyReport",
    "VerifyRunError",
    "compare",
    "report_progress",
    "run_on_rank",
    "verify_schedule",
]


@dataclass(frozen=True)
class RunSpec:
    """One distributed training run (picklable; sent to every rank)."""

    pp: int
    num_microbatches: int
    schedule_csv: str | None = None  # required for OURS
    mode: str = OURS
    tp: int = 1
    model: TinyGPTSpec = field(default_factory=TinyGPTSpec)
    iterations: int = 3
    use_ddp: bool = True
    sequence_parallel: bool = False
    forward_only: bool = False
    trace: bool = False
    split_backward: bool = False  # install the weight-gradient hooks (schedules with B/W ops)
    timeout_s: float = 60.0
    # False: every message carries tag 0, as on NCCL (which ignores tags): matching relies on order alone.
    p2p_tags: bool = True
    # Adam normalises every element, so fp32 re-association noise in near-zero gradients (the tied
    # embedding's two partial sums, backward orders that differ from the reference) becomes an
    # O(lr) weight difference after a step; a small lr keeps that noise far below the 1e-6
    # tolerance, while a schedule bug still shows up as an O(1) gradient difference.
    lr: float = 1e-4
    keep_grads: bool = True  # benchmarks turn this off
    # Profile-guided re-planning: build `replan_schedule` with default costs, re-plan after this many iterations.
    replan_schedule: str | None = None
    replan_memory_limit: float | None = None
    profile_iterations: int = 0
    replan_initial_costs: str | None = None  # "F,B,W,COMM" to start from instead of the generator's defaults
    # Testing aid: a different schedule for some pipeline ranks (to provoke a mismatch).
    schedule_csv_overrides: tuple[tuple[int, str], ...] = ()
    # Data parallelism: dp replicas of the pipeline, each on its share of dp x num_microbatches
    # micro-batches. With dp > 1 gradients are reduced by megatron DDP with overlap_grad_reduce,
    # launched where the collectives pass places each chunk's reduction.
    dp: int = 1
    distributed_optimizer: bool = False  # megatron's DistributedOptimizer (reduce-scatter + param all-gather)
    # Fully sharded data parallelism per chunk (runtime/fsdp.py) instead of megatron DDP: the executor
    # gathers and frees each chunk's parameters where the collectives pass places it, at most
    # ``fsdp_max_unsharded`` chunks gathered at once.
    fsdp: bool = False
    fsdp_max_unsharded: int = 1
    fsdp_grad_reduce_unit: int | None = (
        None  # FSDP: reduce gradients once per this many micro-batches (None: per iteration)
    )
    check_messages: bool = False  # --pipeline-check-messages: a header with every message, checked on arrival
    check_agreement: bool = True  # testing aid: False skips the start-of-run schedule agreement
    # Mode AB with interleaving: run megatron's interleaved schedule with overlap_p2p_comm (and batch_p2p_comm
    # off), as Megatron-LM requires at PP=2 (with batched p2p megatron swaps the two messages to the one peer).
    megatron_overlap_p2p: bool = False
    # Testing aid: a different schedule for some pipeline ranks from the re-plan on (to provoke a mismatch there).
    replan_overrides: tuple[tuple[int, str], ...] = ()
    # megatron-core's optimizer (get_megatron_optimizer: Adam, clipping at clip_grad, loss scaling with found-inf
    # skip when loss_scale is set) instead of torch's Adam; post_validation wraps it (runtime/post_validation.py).
    megatron_optimizer: bool = False
    clip_grad: float = 0.0
    loss_scale: float | None = None
    post_validation: bool = False
    # False: validate before the next iteration's forward-backward; True: after it, before the next step
    # (the next iteration runs on the eagerly stepped weights and is run again when validation changed them)
    post_validation_late: bool = False
    # Testing aid: (iteration, pipeline rank) pairs whose first gradient element is made inf before the step.
    inject_inf: tuple[tuple[int, int], ...] = ()
    keep_weights: bool = False  # report every parameter after the last step
    # The exact reference of the verdict (verification/criterion.py): the model, its gradients and
    # the optimizer in float64, megatron's cross-entropy too.
    float64: bool = False
    # Testing aid: deliberate faults injected into OURS runs (verification/breaks.py).
    breaks: tuple[str, ...] = ()
    adam_eps: float = 1e-8  # Adam's epsilon (torch's and megatron's optimizer); verification raises it
    # "cpu": megatron's CPU shims (forced even where CUDA exists). "cuda": every rank's model and data on GPU 0
    # (ranks share it), p2p over gloo staged through host memory (host_staging.py); results come back on CPU.
    device: str = "cpu"
    stage_p2p_through_host: bool = False  # testing aid: host staging on a CPU run too (always on with "cuda")

    @property
    def world_size(self) -> int:
        return self.pp * self.tp * self.dp


# ------------------------------------------------------------------------------------------------
# What runs on one rank
# ------------------------------------------------------------------------------------------------
def run_on_rank(spec: RunSpec, rank: int, init_method: str) -> dict[str, Any]:
    from .host_staging import prepare_rank, to_cpu

    prepare_rank(spec.device, spec.stage_p2p_through_host)
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from ..runtime import agreement, p2p

    p2p.set_check_messages(spec.check_messages)  # pool workers are reused: set it every run
    agreement.set_enabled(spec.check_agreement)

    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=spec.world_size,
        timeout=datetime.timedelta(seconds=max(30.0, spec.timeout_s)),
    )
    report_progress(f"rank {rank} of {spec.world_size} started")
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=spec.tp, pipeline_model_parallel_size=spec.pp)
        from . import tiny_gpt
        from .breaks import injected

        with contextlib.ExitStack() as stack:
            if spec.float64:
                stack.enter_context(tiny_gpt.float64_cross_entropy())
            stack.enter_context(injected(spec.breaks if spec.mode == OURS else ()))
            return to_cpu(_train(spec, torch, ps))
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()
        # A run's megatron modules form reference cycles (the config holds DDP's bound sync functions, the
        # modules hold the config) that keep its process groups alive until the cycle collector runs, and
        # an idle pool worker allocates too little to trigger it: collect now, or each run's gloo groups
        # (~19 threads per run, spinning once their peers are gone) pile up in the reused worker.
        gc.collect()


def _train(spec: RunSpec, torch: Any, ps: Any) -> dict[str, Any]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from ..runtime.executor import make_forward_backward_func
    from ..runtime.trace import Tracer
    from ..schedules.placement import loop_placement
    from ..schedules.schedule import Schedule
    from . import tiny_gpt

    pp_rank = ps.get_pipeline_model_parallel_rank()
    tp_rank = ps.get_tensor_model_parallel_rank()
    dp_rank = ps.get_data_parallel_rank()
    csv_text = dict(spec.schedule_csv_overrides).get(pp_rank, spec.schedule_csv)
    schedule = Schedule.from_csv(csv_text) if csv_text else None
    placement = schedule.placement if schedule is not None else loop_placement(spec.pp)
    if spec.split_backward:
        from ..runtime.wgrad_hooks import install_wgrad_hooks

        install_wgrad_hooks()

    config = tiny_gpt.make_config(spec.model, tp=spec.tp, sequence_parallel=spec.sequence_parallel)
    chunks, layouts = tiny_gpt.build_chunks(config, spec.model, placement, pp_rank)
    if spec.float64:
        chunks = tiny_gpt.widen_to_float64(chunks, config)
    if spec.device == "cuda":
        chunks = [c.cuda() for c in chunks]
    overlap = spec.dp > 1 or spec.distributed_optimizer
    fsdp_memory = None
    if spec.fsdp:
        from ..runtime.fsdp import FsdpMemory, ShardedChunk, finalize_sharded_grads

        fsdp_memory = FsdpMemory()
        chunks = [
            ShardedChunk(
                c, ps.get_data_parallel_group(), name=f"chunk{i}", memory=fsdp_memory, timeout_s=spec.timeout_s
            )
            for i, c in enumerate(chunks)
        ]
        config.grad_sync_func = [lambda params, c=c: c.start_grad_reduce() for c in chunks]
        config.finalize_model_grads_func = finalize_sharded_grads
    elif spec.use_ddp:
        ddp_config = DistributedDataParallelConfig(
            overlap_grad_reduce=overlap,
            use_distributed_optimizer=spec.distributed_optimizer,
            overlap_param_gather=spec.distributed_optimizer,
        )
        chunks = [
            DistributedDataParallel(config=config, ddp_config=ddp_config, module=c, disable_bucketing=(i > 0))
            for i, c in enumerate(chunks)
        ]
        config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
        # as megatron's training loop does with overlap_grad_reduce / overlap_param_gather and align_*: a list
        # with virtual stages, a function without (what megatron's own schedules expect)
        if overlap:
            grad_sync = [c.start_grad_sync for c in chunks]
            config.grad_sync_func = grad_sync if len(chunks) > 1 else grad_sync[0]
        if spec.distributed_optimizer:
            param_sync = [c.start_param_sync for c in chunks]
            config.param_sync_func = param_sync if len(chunks) > 1 else param_sync[0]
        config.finalize_model_grads_func = finalize_model_grads
    params = [p for c in chunks for p in c.parameters()]
    validator: Any = None
    if spec.fsdp:
        optimizer = _torch_optimizer(spec, [p for c in chunks for p in c.optimizer_params()])
    elif spec.distributed_optimizer or spec.megatron_optimizer:
        optimizer = _megatron_optimizer(spec, chunks)
        if spec.post_validation:
            from ..runtime.post_validation import wrap

            optimizer = validator = wrap(optimizer, params, spec.distributed_optimizer)
    else:
        optimizer = _torch_optimizer(spec, params)
    replica_group = None
    if placement.num_replicas == 2 and spec.mode == OURS:
        from ..runtime.replica_sync import new_replica_group

        replica_group = new_replica_group(ps.get_pipeline_model_parallel_group())
    # micro-batch of each loss this rank reports (in the order the executor stores them)
    loss_microbatches = (
        [op.microbatch for op in schedule.ops[pp_rank] if op.kind == "F" and placement.is_last(op.stage)]
        if schedule is not None and spec.mode == OURS
        else None
    )

    tracer: Tracer | None = None
    source: Any = None
    if spec.mode == AB:
        assert schedule is not None
        native_func = get_forward_backward_func()
        if len(chunks) > 1:  # megatron's interleaved 1F1B: needs the virtual pipeline size set
            from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_with_interleaving

            ps.set_virtual_pipeline_model_parallel_world_size(len(chunks))
            config.virtual_pipeline_model_parallel_size = len(chunks)
            if spec.megatron_overlap_p2p:
                config.batch_p2p_comm, config.overlap_p2p_comm = False, True
            config.microbatch_group_size_per_vp_stage = int(schedule.params.get("microbatch_group_size") or spec.pp)
            native_func = forward_backward_pipelining_with_interleaving
        return ab_timing(spec, chunks, make_forward_backward_func(lambda m: schedule), native_func)
    if spec.mode == OURS:
        param_storages = {p.untyped_storage().data_ptr() for p in params}
        if spec.trace:
            tracer = Tracer(pp_rank, param_storages)
        if replica_group is not None:
            from ..runtime.replica_sync import ReplicaSync
        if spec.profile_iterations > 0:
            source = _replanning_source(spec, placement.num_ranks, pp_rank)
            profiler = source.make_tracer(tracer)
            forward_backward = make_forward_backward_func(
                source, tracer_factory=lambda r: profiler, timeout_s=spec.timeout_s
            )
        else:
            assert schedule is not None, "our executor needs a schedule"
            forward_backward = make_forward_backward_func(
                lambda m: schedule,
                tracer_factory=(lambda r: tracer) if tracer is not None else None,  # type: ignore[arg-type,return-value]
                timeout_s=spec.timeout_s,
                use_tags=spec.p2p_tags,
                fsdp_max_unsharded=spec.fsdp_max_unsharded if spec.fsdp else None,
                fsdp_grad_reduce_unit=spec.fsdp_grad_reduce_unit if spec.fsdp else None,
                replica_sync=ReplicaSync(chunks, replica_group) if replica_group is not None else None,
            )
    else:
        forward_backward = get_forward_backward_func()

    losses: list[list[float]] = []
    grads: list[dict[str, Any]] = []
    fsdp_counts: list[list[int]] = []  # per iteration, per chunk: parameter all-gathers
    fsdp_reduces: list[list[int]] = []  # per iteration, per chunk: gradient reduce-scatters
    step_times: list[float] = []
    optimizer_times: list[float] = []  # seconds in optimizer.step()
    validation_times: list[float] = []  # post-validation: seconds validating before an iteration
    reruns = 0  # post-validation, late: iterations run again because validation changed the weights
    step_norms: list[float] = []  # megatron's optimizer: the gradient norm each step reported (inf: skipped)
    schedules_used: list[str] = []
    for iteration in range(spec.iterations):
        if torch.distributed.get_rank() == 0:
            report_progress(f"iteration {iteration + 1} of {spec.iterations}")
        if validator is not None and not spec.post_validation_late:  # before these weights are used
            validating = time.perf_counter()
            validator.validate()
            validation_times.append(time.perf_counter() - validating)
        for c in chunks:
            if spec.fsdp:
                c.start_iteration()
            elif spec.use_ddp:
                c.zero_grad_buffer()
            else:
                c.zero_grad(set_to_none=True)
        m = spec.num_microbatches
        batches = tiny_gpt.make_batches(spec.model, iteration, m * spec.dp)[dp_rank * m : (dp_rank + 1) * m]
        if spec.device == "cuda":
            batches = [{k: v.cuda() for k, v in b.items()} for b in batches]
        iterators = [iter(batches) for _ in chunks]
        started = time.perf_counter()
        out = forward_backward(
            forward_step_func=tiny_gpt.forward_step,
            data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks if len(chunks) > 1 or spec.mode == OURS else chunks[0],
            num_microbatches=spec.num_microbatches,
            seq_length=spec.model.seq_length,
            micro_batch_size=spec.model.micro_batch_size,
            decoder_seq_length=spec.model.seq_length,
            forward_only=spec.forward_only,
        )
        if validator is not None and spec.post_validation_late:
            validating = time.perf_counter()
            validator.validate()
            validation_times.append(time.perf_counter() - validating)
            if validator.weights_changed_somewhere():  # this iteration ran on weights that were undone: again
                reruns += 1
                for c in chunks:
                    c.zero_grad_buffer()
                iterators = [iter(batches) for _ in chunks]
                out = forward_backward(
                    forward_step_func=tiny_gpt.forward_step,
                    data_iterator=iterators if len(chunks) > 1 else iterators[0],
                    model=chunks,
                    num_microbatches=spec.num_microbatches,
                    seq_length=spec.model.seq_length,
                    micro_batch_size=spec.model.micro_batch_size,
                    decoder_seq_length=spec.model.seq_length,
                    forward_only=spec.forward_only,
                )
        step_times.append(time.perf_counter() - started)
        if source is not None:
            schedules_used.append(source(spec.num_microbatches).to_csv())
        losses.append([float(d["lm loss"]) for d in out])
        if spec.forward_only:
            continue
        if replica_group is not None and not getattr(forward_backward, "syncs_replicas", False):
            # The executor does not run the schedule's replica-sync collectives yet: sum the two
            # copies' gradients here, after the iteration (BitPipe without its eager overlap).
            from ..runtime.replica_sync import sync_all

            sync_all(placement, pp_rank, chunks, replica_group)
        step: dict[str, Any] = {}
        if spec.fsdp:
            for chunk, layout in zip(chunks, layouts, strict=True):
                chunk.end_iteration()  # reduced once, resharded, nothing pending
                for name, g in chunk.gather_full_grads().items():
                    global_key = tiny_gpt.global_name(name, layout, spec.model.tied_embeddings)
                    step[f"{global_key}#tp{tp_rank}#stage{layout.stage}#dp{dp_rank}"] = g
            fsdp_counts.append([c.counters.all_gathers for c in chunks])
            fsdp_reduces.append([c.counters.reduce_scatters for c in chunks])
            grads.append(step)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            continue
        for chunk, layout in zip(chunks, layouts, strict=True):
            owned = _owned_grad_ranges(chunk, dp_rank, spec.dp) if spec.distributed_optimizer else {}
            for name, p in tiny_gpt._unwrap(chunk).named_parameters():
                g = getattr(p, "main_grad", None) if spec.use_ddp else p.grad
                global_key = tiny_gpt.global_name(name, layout, spec.model.tied_embeddings)
                key = f"{global_key}#tp{tp_rank}#stage{layout.stage}"
                if spec.distributed_optimizer:  # after the reduce-scatter only this rank's shard is reduced
                    for lo, hi in owned.get(p, ()):
                        step[f"{key}#dp{dp_rank}#{lo}:{hi}"] = g.detach().reshape(-1)[lo:hi].clone()
                    continue
                step[f"{key}#dp{dp_rank}"] = g.detach().clone()
                if spec.use_ddp:
                    p.grad = g.detach().clone()
        grads.append(step)
        if (iteration, pp_rank) in spec.inject_inf:
            _inject_inf(chunks[0], spec.use_ddp)
        stepping = time.perf_counter()
        returned = optimizer.step()
        optimizer_times.append(time.perf_counter() - stepping)
        if spec.megatron_optimizer and validator is None:  # (update_successful, grad_norm, zeros)
            step_norms.append(math.inf if not returned[0] else float(returned[1] or 0.0))
        optimizer.zero_grad(set_to_none=True)
    if validator is not None:
        validator.finish()
    result: dict[str, Any] = {
        # what decides fp32 rounding here: the kernels' instruction set and the thread count
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "pp_rank": pp_rank,
        "tp_rank": tp_rank,
        "dp_rank": dp_rank,
        "losses": losses,
        "loss_microbatches": loss_microbatches,
        "grads": grads if spec.keep_grads else [],
        "step_times": step_times,
        "step_norms": step_norms,
        "optimizer_times": optimizer_times,
        "validation_times": validation_times,
        "schedules_used": schedules_used,
        "measured_costs": None if source is None or source.costs is None else repr(source.costs),
    }
    if fsdp_memory is not None:
        result["fsdp"] = {
            "all_gathers_per_iteration": [sum(x) for x in fsdp_counts],
            "reduce_scatters_per_iteration": [sum(x) for x in fsdp_reduces],
            "peak_bytes": dict(fsdp_memory.peak),
            "peak_total_bytes": fsdp_memory.peak_total,
            "mean_bytes": {k: round(v) for k, v in fsdp_memory.mean_bytes().items()},
            "full_param_bytes_per_chunk": [c.full_param_bytes for c in chunks],
        }
    if tracer is not None:
        result["trace"] = tracer.summary()
    if validator is not None:
        result["post_validation"] = {**dataclasses.asdict(validator.stats), "reruns": reruns}
    if replica_group is not None or spec.keep_weights:  # final weights (the two copies of a replica must agree)
        if spec.distributed_optimizer:  # the last step's gathers are overlapped with a next forward: do them
            for c in chunks:
                c.start_param_sync(force_sync=True)
        result["weights"] = {
            f"{tiny_gpt.global_name(name, layout, spec.model.tied_embeddings)}#tp{tp_rank}#stage{layout.stage}"
            + (f"#dp{dp_rank}" if spec.keep_weights else ""): p.detach().clone()
            for chunk, layout in zip(chunks, layouts, strict=True)
            for name, p in tiny_gpt._unwrap(chunk).named_parameters()
        }
    return result


def _inject_inf(chunk: Any, use_ddp: bool) -> None:
    """Testing aid: an overflow in this rank's gradients, as an fp16 backward produces one."""
    from . import tiny_gpt

    p = next(tiny_gpt._unwrap(chunk).parameters())
    g = p.main_grad if use_ddp else p.grad
    g.view(-1)[0] = float("inf")


def _torch_optimizer(spec: RunSpec, params: list[Any]) -> Any:
    import torch

    return torch.optim.Adam(params, lr=spec.lr, eps=spec.adam_eps)


def _megatron_optimizer(spec: RunSpec, chunks: list[Any]) -> Any:
    """megatron-core's (distributed) Adam, as the training loop builds it; no weight decay. With a loss
    scale, megatron's mixed-precision wrapper (fp32 parameters kept as they are; a constant scaler and
    its found-inf check and skip)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from ..megatron.cpu import enable_megatron_optimizer_on_cpu

    enable_megatron_optimizer_on_cpu()

    config = OptimizerConfig(
        optimizer="adam",
        lr=spec.lr,
        adam_eps=spec.adam_eps,
        weight_decay=0.0,
        clip_grad=spec.clip_grad,
        use_distributed_optimizer=spec.distributed_optimizer,
        bf16=spec.loss_scale is not None,  # selects the mixed-precision wrapper; parameters stay fp32
        loss_scale=spec.loss_scale,
    )
    return get_megatron_optimizer(config, chunks)


def _owned_grad_ranges(ddp_chunk: Any, dp_rank: int, dp: int) -> dict[Any, list[tuple[int, int]]]:
    """Per parameter, the element ranges (of its flattened grad) inside this data-parallel rank's
    shard of the grad buffer: after megatron's reduce-scatter only those hold the reduced gradient."""
    owned: dict[Any, list[tuple[int, int]]] = {}
    for buffer in ddp_chunk.buffers:
        for param, (start, end, bucket_id) in buffer.param_index_map.items():
            bucket = buffer.buckets[bucket_id]
            shard = bucket.grad_data.numel() // dp
            lo = max(start, bucket.offset + dp_rank * shard)
            hi = min(end, bucket.offset + (dp_rank + 1) * shard)
            if lo < hi:
                owned.setdefault(param, []).append((lo - start, hi - start))
    return owned


def _replanning_source(spec: RunSpec, p: int, pp_rank: int = 0) -> Any:
    from ..analysis.validate import validate
    from ..runtime.replan import ReplanningSource
    from ..schedules import registry

    assert spec.replan_schedule is not None, "profile_iterations needs replan_schedule"
    name = spec.replan_schedule

    from ..analysis.simulate import Costs

    initial = Costs.parse(spec.replan_initial_costs) if spec.replan_initial_costs else None

    def build(m: int, costs: Any) -> Any:
        this_name = name if costs is None else dict(spec.replan_overrides).get(pp_rank, name)
        costs = costs if costs is not None else initial
        kwargs: dict[str, Any] = {"memory_limit": spec.replan_memory_limit}
        if costs is not None and this_name == name:
            kwargs["costs"] = costs
        schedule = registry.generate(this_name, p, m, **kwargs)
        validate(schedule)
        return schedule

    return ReplanningSource(build, spec.profile_iterations, log=lambda text: None)


class RankPool(rank_pool.RankPool):
    """A :class:`~.rank_pool.RankPool` that also runs training specs."""

    def run(self, spec: RunSpec, wall_timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Run one training run (:func:`run_on_rank`) on ``spec.world_size`` ranks."""
        return self.run_fn(run_on_rank, spec, spec.world_size, wall_timeout_s or (spec.timeout_s * 4 + 120))

    def __enter__(self) -> RankPool:
        return self


def _is_megatron_1f1b(schedule: Any) -> bool:
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
    run's data-parallel grouping (``dp`` replicas, DDP or distributed optimizer as the run)."""
    common = {
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
        "stage_p2p_through_host": spec.stage_p2p_through_host,
    }
    exact = RunSpec(num_microbatches=spec.num_microbatches * spec.dp, float64=True, **common)  # type: ignore[arg-type]
    reference = RunSpec(
        num_microbatches=spec.num_microbatches,
        dp=spec.dp,
        distributed_optimizer=spec.distributed_optimizer,
        **common,  # type: ignore[arg-type]
    )
    return exact, reference


def reference_runs(
    pool: RankPool, spec: RunSpec, phase: Any = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Run :func:`reference_specs` of ``spec`` on ``pool``: ``(exact, reference)`` results, checked.
    ``phase`` (callable(text)) is told which reference is running."""
    results = []
    names = ("exact reference (float64)", "megatron's fp32 reference")
    for name, ref_spec in zip(names, reference_specs(spec), strict=True):
        if phase is not None:
            phase(name)
        results.append(pool.run(ref_spec))
        _check_errors(results[-1])
    return results[0], results[1]


def verify_schedule(
    schedule: Any,
    pool: RankPool | None = None,
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
    distributed_optimizer: bool = False,
    fsdp: bool = False,
    fsdp_max_unsharded: int = 1,
    fsdp_grad_reduce_unit: int | None = None,
    lr: float | None = None,
    progress: Any = None,
    breaks: tuple[str, ...] = (),
    device: str = "cpu",
    stage_p2p_through_host: bool = False,
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
    ``breaks``: deliberate faults injected into the schedule's run (:mod:`.breaks`; tests of the verdict's
    sharpness).

    ``device`` (:class:`RunSpec`): ``"cuda"`` runs every rank on GPU 0 (p2p staged through host memory);
    a pool's processes keep the device of their first run, so give a ``"cuda"`` run a pool of its own.
    """
    if fsdp and distributed_optimizer:
        raise ValueError("--fsdp shards gradients and optimizer state itself: drop --distributed-optimizer")
    if fsdp and (model is None or model.tied_embeddings):
        raise ValueError("--fsdp supports untied embeddings only for now (add --untied-embeddings)")
    from ..analysis.validate import validate

    validate(schedule)
    p, m = schedule.num_ranks, schedule.num_microbatches
    if fsdp:  # the ranks get the schedule as CSV, without its declarations: pass the policy explicitly
        from ..schedules.collectives import policy_for

        resolved = policy_for(
            schedule, fsdp=True, fsdp_max_unsharded=fsdp_max_unsharded, grad_reduce_unit=fsdp_grad_reduce_unit
        ).grad_reduce_unit
        fsdp_grad_reduce_unit = resolved or m  # a unit of m micro-batches: once per iteration, whatever is declared
    if model is None:
        model = TinyGPTSpec(num_layers=schedule.placement.stages_per_replica)
    split = schedule.splits_backward
    common = {
        "tp": tp,
        "model": model,
        "iterations": iterations,
        "use_ddp": use_ddp,
        "sequence_parallel": sequence_parallel,
        "timeout_s": timeout_s,
        "device": device,
        "stage_p2p_through_host": stage_p2p_through_host,
    }
    common["adam_eps"] = criterion.ADAM_EPS
    common["lr"] = criterion.LR if lr is None else lr
    own_pool = pool is None
    say = progress or (lambda text: None)
    if own_pool:
        say(f"starting {p * tp * dp} rank process(es) (imports take ~10 s per process)")
    pool = pool or RankPool(p * tp * dp)
    saved = pool.on_progress
    phase = [""]
    pool.on_progress = lambda text: say(f"{phase[0]}: {text}") if progress else None
    try:
        ours = RunSpec(
            pp=p,
            num_microbatches=m,
            dp=dp,
            distributed_optimizer=distributed_optimizer,
            fsdp=fsdp,
            fsdp_max_unsharded=fsdp_max_unsharded,
            fsdp_grad_reduce_unit=fsdp_grad_reduce_unit,
            mode=OURS,
            schedule_csv=schedule.to_csv(),
            trace=trace,
            split_backward=split,
            p2p_tags=p2p_tags,
            breaks=breaks,
            **common,  # type: ignore[arg-type]
        )
        exact, ref = reference_runs(pool, ours, lambda text: phase.__setitem__(0, text))
        phase[0] = f"{schedule.name} on {p * tp * dp} ranks"
        run = pool.run(ours)
        _check_errors(run)
        native = None
        if not fsdp and _is_megatron_1f1b(schedule):  # the same arithmetic as megatron's 1F1B: bit for bit
            phase[0] = f"megatron's own 1F1B on {p * tp * dp} ranks"
            native = pool.run(dataclasses.replace(ours, mode=NATIVE, trace=False, split_backward=False, breaks=()))
            _check_errors(native)
    finally:
        pool.on_progress = saved
        if own_pool:
            pool.close()
    say("comparing losses and every gradient with the references")
    report = compare(schedule.name, p, m, schedule.chunks_per_rank, ref, run, tol, exact)
    if native is not None:
        check_bitwise(report, native, run)
    if fsdp:
        _check_fsdp_collectives(report, schedule, run, fsdp_max_unsharded, fsdp_grad_reduce_unit)
    return report
