"""``megatron-pp verify``: run a schedule on real gloo ranks and compare with a reference.

A run spawns ranks on this machine (a :class:`RankPool`, reusable across runs),
builds a tiny GPTModel split by the schedule's placement, trains a few
iterations with Adam and records every loss and every parameter gradient. The
reference is the same model, unpartitioned (pipeline size 1, same tensor
parallel size), trained by megatron-core's own no-pipelining schedule with the
same seed and data. The report gives the largest relative gradient difference
and absolute loss difference over all iterations.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import queue
import socket
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from .tiny_gpt import TinyGPTSpec

NATIVE = "native"  # megatron-core's own forward_backward_func
OURS = "ours"  # megatron_pp_ext's executor
AB = "ab"  # timing: each iteration runs megatron's function and ours, in alternating order


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
        return to_cpu(_train(spec, torch, ps))
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


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
        if overlap:  # as megatron's training loop does with overlap_grad_reduce and align_grad_reduce
            config.grad_sync_func = [c.start_grad_sync for c in chunks]
        if spec.distributed_optimizer:  # likewise with overlap_param_gather and align_param_gather
            config.param_sync_func = [c.start_param_sync for c in chunks]
        config.finalize_model_grads_func = finalize_model_grads
    params = [p for c in chunks for p in c.parameters()]
    validator: Any = None
    if spec.fsdp:
        optimizer = torch.optim.Adam([p for c in chunks for p in c.optimizer_params()], lr=spec.lr)
    elif spec.distributed_optimizer or spec.megatron_optimizer:
        optimizer = _megatron_optimizer(spec, chunks)
        if spec.post_validation:
            from ..runtime.post_validation import wrap

            optimizer = validator = wrap(optimizer, params, spec.distributed_optimizer)
    else:
        optimizer = torch.optim.Adam(params, lr=spec.lr)
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
        return _ab_timing(spec, chunks, make_forward_backward_func(lambda m: schedule), native_func)
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


def _ab_timing(spec: RunSpec, chunks: list[Any], ours: Any, native: Any) -> dict[str, Any]:
    """Time megatron's function and ours on the same ranks, model and data, alternating which goes first;
    then one more iteration of each under :class:`SavedBytesMeter` (peak bytes autograd holds for backward)."""
    from . import tiny_gpt

    multi = len(chunks) > 1  # megatron's interleaved schedule takes the chunk and iterator lists, like ours

    def step(name: str, func: Any, iteration: int) -> list[float]:
        for c in chunks:
            c.zero_grad_buffer()
        batches = tiny_gpt.make_batches(spec.model, iteration, spec.num_microbatches)
        out = func(
            forward_step_func=tiny_gpt.forward_step,
            data_iterator=[iter(batches) for _ in chunks] if multi else iter(batches),
            model=chunks if name == OURS or multi else chunks[0],
            num_microbatches=spec.num_microbatches,
            seq_length=spec.model.seq_length,
            micro_batch_size=spec.model.micro_batch_size,
            decoder_seq_length=spec.model.seq_length,
        )
        return [float(d["lm loss"]) for d in out]

    times: dict[str, list[float]] = {NATIVE: [], OURS: []}
    losses: dict[str, list[list[float]]] = {NATIVE: [], OURS: []}
    for iteration in range(spec.iterations):
        order = [(NATIVE, native), (OURS, ours)]
        if iteration % 2:
            order.reverse()
        for name, func in order:
            started = time.perf_counter()
            losses[name].append(step(name, func, iteration))
            times[name].append(time.perf_counter() - started)
    params = {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()}
    peak: dict[str, int] = {}
    for name, func in ((NATIVE, native), (OURS, ours)):
        meter = SavedBytesMeter(params)
        with meter:
            step(name, func, spec.iterations)
        peak[name] = meter.peak
    return {"step_times": times, "losses": losses, "peak_saved_bytes": peak}


class SavedBytesMeter:
    """Live bytes of the tensors autograd saves for backward (parameters excluded), and their peak.

    A saved tensor counts from its pack until autograd drops it (after its backward); a storage saved
    several times counts once. Measures any forward-backward function alike (megatron's or ours)."""

    def __init__(self, param_storages: set[int]) -> None:
        self.params = param_storages
        self.refs: dict[int, int] = {}
        self.live = 0
        self.peak = 0
        self._hooks: Any = None

    def _pack(self, tensor: Any) -> Any:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.params or storage.nbytes() == 0:
            return tensor
        count = self.refs.get(ptr, 0)
        self.refs[ptr] = count + 1
        if count == 0:
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
        return _Saved(self, tensor, ptr, storage.nbytes())

    def _release(self, ptr: int, nbytes: int) -> None:
        count = self.refs.pop(ptr) - 1
        if count:
            self.refs[ptr] = count
        else:
            self.live -= nbytes

    @staticmethod
    def _unpack(packed: Any) -> Any:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def __enter__(self) -> SavedBytesMeter:
        import torch

        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


class _Saved:
    __slots__ = ("meter", "nbytes", "ptr", "tensor")

    def __init__(self, meter: SavedBytesMeter, tensor: Any, ptr: int, nbytes: int) -> None:
        self.meter, self.tensor, self.ptr, self.nbytes = meter, tensor, ptr, nbytes

    def __del__(self) -> None:
        self.meter._release(self.ptr, self.nbytes)


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


# ------------------------------------------------------------------------------------------------
# A pool of rank processes, spawned once
# ------------------------------------------------------------------------------------------------
_PROGRESS: tuple[int, Any] | None = None  # (worker index, outbox) inside a pool worker


def report_progress(text: str) -> None:
    """From a rank: a progress line for the driver (``RankPool(on_progress=...)``); no-op elsewhere."""
    if _PROGRESS is not None:
        _PROGRESS[1].put(("progress", _PROGRESS[0], text))


def _worker(index: int, inbox: Any, outbox: Any, driver_pid: int | None = None) -> None:
    global _PROGRESS
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _PROGRESS = (index, outbox)
    parent = os.getppid() if driver_pid is None else driver_pid  # the driver may be gone already
    while True:
        try:
            job = inbox.get(timeout=5.0)
        except queue.Empty:
            if os.getppid() != parent:  # the driver died (killed): do not linger as an orphan
                return
            continue
        if job is None:  # the pool closes: flush the results, then skip torch's interpreter teardown
            outbox.close()
            outbox.join_thread()
            os._exit(0)
        fn, payload, rank, init_method = job
        try:
            outbox.put((index, fn(payload, rank, init_method)))
        except BaseException as exc:  # report every failure to the driver, with the rank
            outbox.put((index, {"error": f"rank {rank}: {type(exc).__name__}: {exc}", "tb": traceback.format_exc()}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RankPool:
    """``size`` spawned rank processes that run jobs; reuse it across runs.

    When a rank fails, the others get ``grace_s`` seconds to finish (a peer of a
    failed rank is usually stuck in a collective with it); ranks still running
    then are killed and reported as such, and the pool respawns its processes on
    the next run.
    """

    def __init__(self, size: int, grace_s: float = 15.0, on_progress: Any = None) -> None:
        self.size = size
        self.grace_s = grace_s
        self.on_progress = on_progress  # callable(text) for the ranks' progress lines, or None
        self.procs: list[Any] = []
        self._spawn()

    def _spawn(self) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(self.size)]
        driver = os.getpid()
        self.procs = [
            ctx.Process(target=_worker, args=(i, self.inboxes[i], self.outbox, driver), daemon=True)
            for i in range(self.size)
        ]
        for p in self.procs:
            p.start()

    def run(self, spec: RunSpec, wall_timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Run one training run (:func:`run_on_rank`) on ``spec.world_size`` ranks."""
        return self.run_fn(run_on_rank, spec, spec.world_size, wall_timeout_s or (spec.timeout_s * 4 + 120))

    def run_fn(self, fn: Any, payload: Any, world_size: int, wall_timeout_s: float = 300.0) -> list[Any]:
        """Call ``fn(payload, rank, init_method)`` on ranks ``0..world_size-1``; ``fn`` must be importable."""
        if world_size > self.size:
            raise ValueError(f"run needs {world_size} ranks, the pool has {self.size}")
        if not self.procs or not all(p.is_alive() for p in self.procs):
            self.close(kill=True)
            self._spawn()
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        for rank in range(world_size):
            self.inboxes[rank].put((fn, payload, rank, init_method))
        results: dict[int, Any] = {}
        deadline = time.monotonic() + wall_timeout_s
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(results))
                self.close(kill=True)
                if any(isinstance(r, dict) and "error" in r for r in results.values()):
                    for rank in missing:
                        results[rank] = {"error": f"rank {rank}: killed after another rank failed", "tb": ""}
                    break
                raise TimeoutError(f"ranks {missing} did not finish within {wall_timeout_s:g}s; the pool was killed")
            try:
                message = self.outbox.get(timeout=min(remaining, 2.0))
                if len(message) == 3:  # ("progress", worker, text)
                    if self.on_progress is not None:
                        self.on_progress(message[2])
                    continue
                index, result = message
            except queue.Empty:
                dead = [i for i in range(world_size) if not self.procs[i].is_alive()]
                if dead:
                    self.close(kill=True)
                    raise RuntimeError(f"rank process(es) {dead} died") from None
                continue
            results[index] = result
            if isinstance(result, dict) and "error" in result:
                deadline = min(deadline, time.monotonic() + self.grace_s)
        return [results[r] for r in range(world_size)]

    def close(self, kill: bool = False) -> None:
        for i, p in enumerate(self.procs):
            if p.is_alive():
                if kill:
                    p.kill()
                else:
                    self.inboxes[i].put(None)
        for p in self.procs:
            p.join(timeout=10)
        self.procs = []

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(kill=exc[0] is not None)


# ------------------------------------------------------------------------------------------------
# Comparison
# ------------------------------------------------------------------------------------------------
class VerifyRunError(RuntimeError):
    """A rank failed while running the schedule."""


@dataclass
class VerifyReport:
    schedule: str
    p: int
    m: int
    v: int
    ok: bool
    max_rel_grad_diff: float
    max_abs_loss_diff: float
    bitwise_equal: bool
    iterations: int
    losses: list[float]
    peak_activation_bytes: list[int] = field(default_factory=list)
    # per pipeline rank: the measured bytes of one activation of each of its stages ({stage: bytes})
    stage_activation_bytes: list[dict[int, int]] = field(default_factory=list)
    measured_bubble_rate: list[float] = field(default_factory=list)
    # per pipeline rank (data-parallel replica 0): the derived collectives launched in the last
    # iteration, in order, each with whether it started before the rank's last backward ended
    collectives: list[list[str]] = field(default_factory=list)
    # FSDP runs, per pipeline rank: gathers derived vs measured per iteration, peak bytes held
    fsdp: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    tolerance: float = 1e-6

    def to_json_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_errors(results: list[dict[str, Any]]) -> None:
    errors = [r for r in results if "error" in r]
    if errors:
        first = next((r for r in errors if "killed after" not in r["error"]), errors[0])
        raise VerifyRunError(first["error"] + "\n" + first.get("tb", ""))


def _losses(results: list[dict[str, Any]]) -> list[list[float]]:
    """Per iteration, the micro-batch losses of the whole global batch: data-parallel replica by
    replica (tensor-parallel rank 0), and within one the losses of every rank that computed some
    (a bidirectional schedule computes them on two ranks) in micro-batch order (a schedule may run
    the last stage's forwards out of micro-batch order)."""
    holders = [r for r in results if r["losses"] and r["losses"][0] and r.get("tp_rank", 0) == 0]
    if not holders:
        raise VerifyRunError("no rank reported a loss")
    by_dp: dict[int, list[dict[str, Any]]] = {}
    for r in holders:
        by_dp.setdefault(r.get("dp_rank", 0), []).append(r)
    merged: list[list[float]] = []
    for it in range(len(holders[0]["losses"])):
        row: list[float] = []
        for d in sorted(by_dp):
            ranks = by_dp[d]
            if any(r.get("loss_microbatches") is None for r in ranks):  # megatron's own order: by micro-batch
                row += ranks[0]["losses"][it]
                continue
            by_mb: dict[int, float] = {}
            for r in ranks:
                by_mb.update(zip(r["loss_microbatches"], r["losses"][it], strict=True))
            row += [by_mb[mb] for mb in sorted(by_mb)]
        merged.append(row)
    return merged


def _replica_copies_differ(results: list[dict[str, Any]]) -> list[str]:
    """Bidirectional runs: the two copies of every parameter (two stages) must be bitwise equal."""
    import torch

    copies: dict[str, list[tuple[str, Any]]] = {}
    for r in results:
        for key, w in r.get("weights", {}).items():
            name, tp, stage = key.split("#")
            copies.setdefault(f"{name}#{tp}", []).append((stage, w))
    problems = []
    for key, found in sorted(copies.items()):  # 2 copies; a tied embedding 4 (each replica's two ends)
        if len(found) < 2:
            problems.append(f"{key}: {len(found)} copy only, expected one per replica")
        for stage, w in found[1:]:
            if not torch.equal(found[0][1], w):
                diff = float((found[0][1] - w).abs().max())
                problems.append(f"{key}: copies {found[0][0]} and {stage} differ after training (max {diff:g})")
    return problems


def compare(
    name: str, p: int, m: int, v: int, ref: list[dict[str, Any]], run: list[dict[str, Any]], tol: float = 1e-6
) -> VerifyReport:
    """Compare a pipeline run with its reference (both already checked for errors)."""
    import torch

    ref_losses = _losses(ref)
    run_losses = _losses(run)
    problems: list[str] = []
    problems += _replica_copies_differ(run)
    loss_diff = 0.0
    bitwise = True
    for it, (a, b) in enumerate(zip(run_losses, ref_losses, strict=True)):
        if len(a) != len(b):
            problems.append(f"iteration {it}: {len(a)} losses reported, reference has {len(b)}")
            continue
        for x, y in zip(a, b, strict=True):
            loss_diff = max(loss_diff, abs(x - y))
            bitwise &= x == y
    grad_diff = 0.0
    ref_grads = [
        {f"{k.split('#')[0]}#{k.split('#')[1]}": g for r in ref for k, g in r["grads"][it].items()}
        for it in range(len(ref[0]["grads"]))
    ]
    covered: set[str] = set()
    for r in run:
        for it, step in enumerate(r["grads"]):
            for key, g in step.items():
                parts = key.split("#")
                name_tp = "#".join(parts[:2])
                want = ref_grads[it].get(name_tp)
                if want is None:
                    problems.append(f"iteration {it}: parameter {name_tp} has no reference counterpart")
                    continue
                covered.add(name_tp)
                if len(parts) > 4:  # a shard of the flattened gradient (distributed optimizer)
                    lo, hi = (int(x) for x in parts[4].split(":"))
                    want = want.reshape(-1)[lo:hi]
                if g.shape != want.shape:
                    problems.append(f"{name_tp}: shape {tuple(g.shape)} vs reference {tuple(want.shape)}")
                    continue
                scale = max(float(want.abs().max()), 1e-30)
                diff = float((g - want).abs().max()) / scale
                bitwise &= bool(torch.equal(g, want))
                if diff > grad_diff:
                    grad_diff = diff
    if ref_grads:
        missing = sorted(set(ref_grads[0]) - covered)
        if missing:
            problems.append(f"parameters never produced a gradient on any rank: {missing[:5]}")
    ok = (
        not problems
        and grad_diff <= tol
        and loss_diff <= tol * max(1.0, abs(ref_losses[0][0]) if ref_losses[0] else 1.0)
    )
    traces = [
        r.get("trace")
        for r in sorted(run, key=lambda r: (r["pp_rank"], r["tp_rank"]))
        if r["tp_rank"] == 0 and r.get("dp_rank", 0) == 0
    ]
    return VerifyReport(
        schedule=name,
        p=p,
        m=m,
        v=v,
        ok=ok,
        max_rel_grad_diff=grad_diff,
        max_abs_loss_diff=loss_diff,
        bitwise_equal=bitwise,
        iterations=len(run_losses),
        losses=[sum(x) / len(x) if x else float("nan") for x in run_losses],
        peak_activation_bytes=[t["peak_activation_bytes"] for t in traces if t],
        stage_activation_bytes=[{int(k): int(b) for k, b in t["stage_activation_bytes"].items()} for t in traces if t],
        measured_bubble_rate=[t["measured_bubble_rate"] for t in traces if t],
        collectives=[_launches(t) for t in traces if t],
        problems=problems,
        tolerance=tol,
    )


def _launches(trace: dict[str, Any]) -> list[str]:
    last = trace["per_iteration"][-1] if trace.get("per_iteration") else {}
    return [
        f"{c['kind']}[s{c['stage']}]{' (overlaps backward)' if c['before_last_backward_end'] else ''}"
        for c in last.get("collectives", [])
    ]


def default_tolerance(dp: int) -> float:
    """Largest relative gradient difference accepted against the reference.

    1e-6 without data parallelism. With it, the data-parallel all-reduce adds the replicas'
    partial sums in another order than the reference's single sum (measured: 1.4e-7 at the first
    iteration, 1f1b p=2 dp=2), and Adam turns that into weight differences that reach 2.5e-6
    after two steps; 1e-5 stays far below what a wrong schedule or a missing reduction gives (O(1)).
    """
    return 1e-6 if dp == 1 else 1e-5


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
    device: str = "cpu",
    stage_p2p_through_host: bool = False,
) -> VerifyReport:
    """Run ``schedule`` (a validated Schedule) and its reference; return the comparison.
    ``progress`` (callable(text)) gets the steps as they happen: ranks started, iterations, comparison.

    With ``dp`` > 1 the pipeline runs ``dp`` times (``p x tp x dp`` ranks), each replica on its
    share of ``dp x m`` micro-batches; the reference runs all of them in one process. ``tol``
    defaults to :func:`default_tolerance`. ``fsdp_grad_reduce_unit``: with ``fsdp``, reduce each chunk's
    gradients once per that many micro-batches (default: the schedule's declared unit, e.g. ZeroPP's U; else
    once per iteration).

    ``lr`` (Adam) defaults to :class:`RunSpec`'s, and to a tenth of it under a bidirectional
    placement: there the two replicas' partial gradients are summed, ``(g0+g1)+(g2+g3)`` against
    the reference's ``((g0+g1)+g2)+g3``, which re-associates every parameter's gradient (about
    1e-7 relative in the first iteration), and Adam's normalisation turns sign flips of
    near-zero elements into ``O(lr)`` weight differences that the next iterations' gradients show.
    Likewise under FSDP with gradients reduce-scattered per unit (``fsdp_grad_reduce_unit``): the shard sums
    the units' partial gradients, ``(g0+g1)+(g2+g3)`` again (measured: zeropp p=4, m=8, dp=2, U=1 agrees to
    2.4e-7 in the first iteration and drifts to 4.8e-5 after two Adam steps at the default rate).

    ``device`` (:class:`RunSpec`): ``"cuda"`` runs every rank on GPU 0 (p2p staged through host memory);
    a pool's processes keep the device of their first run, so give a ``"cuda"`` run a pool of its own.
    """
    tol = default_tolerance(dp) if tol is None else tol
    if fsdp and distributed_optimizer:
        raise ValueError("--fsdp shards gradients and optimizer state itself: drop --distributed-optimizer")
    if fsdp and (model is None or model.tied_embeddings):
        raise ValueError("--fsdp supports untied embeddings only for now (add --untied-embeddings)")
    from ..analysis.validate import validate

    validate(schedule)
    p, m = schedule.num_ranks, schedule.num_microbatches
    per_unit = False  # FSDP gradients reduce-scattered per unit (not once per iteration)
    if fsdp:  # the ranks get the schedule as CSV, without its declarations: pass the policy explicitly
        from ..schedules.collectives import policy_for

        resolved = policy_for(
            schedule, fsdp=True, fsdp_max_unsharded=fsdp_max_unsharded, grad_reduce_unit=fsdp_grad_reduce_unit
        ).grad_reduce_unit
        per_unit = resolved is not None
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
    if lr is not None or schedule.placement.num_replicas > 1 or per_unit:
        common["lr"] = lr if lr is not None else RunSpec.lr / 10
    own_pool = pool is None
    say = progress or (lambda text: None)
    if own_pool:
        say(f"starting {p * tp * dp} rank process(es) (imports take ~10 s per process)")
    pool = pool or RankPool(p * tp * dp)
    saved = pool.on_progress
    phase = ["reference"]
    pool.on_progress = lambda text: say(f"{phase[0]}: {text}") if progress else None
    try:
        ref = pool.run(RunSpec(pp=1, mode=NATIVE, num_microbatches=m * dp, **common))  # type: ignore[arg-type]
        _check_errors(ref)
        phase[0] = f"{schedule.name} on {p * tp * dp} ranks"
        run = pool.run(
            RunSpec(
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
                **common,  # type: ignore[arg-type]
            )
        )
        _check_errors(run)
    finally:
        pool.on_progress = saved
        if own_pool:
            pool.close()
    say("comparing losses and every gradient with the reference")
    report = compare(schedule.name, p, m, schedule.chunks_per_rank, ref, run, tol)
    if fsdp:
        _check_fsdp_collectives(report, schedule, run, fsdp_max_unsharded, fsdp_grad_reduce_unit)
    return report


def _check_fsdp_collectives(
    report: VerifyReport, schedule: Any, run: list[dict[str, Any]], limit: int, unit: int | None
) -> None:
    """FSDP: every rank gathered its chunks and reduce-scattered their gradients exactly as often per
    iteration as the lowering derived, counted twice: by the chunks (``ShardedChunk`` counters) and by the
    trace (the executor's launches of derived ``reduce-grads``)."""
    from ..schedules.collectives import CollectiveKind, derive_collectives, fsdp_policy

    plan = derive_collectives(schedule, fsdp_policy(schedule, limit, unit))
    for r in sorted(run, key=lambda r: (r["pp_rank"], r["dp_rank"], r["tp_rank"])):
        where = f"pipeline rank {r['pp_rank']} dp rank {r['dp_rank']}"
        derived = plan.count(CollectiveKind.UNSHARD, r["pp_rank"])
        derived_reduces = plan.count(CollectiveKind.REDUCE_GRADS, r["pp_rank"])
        measured = r["fsdp"]["all_gathers_per_iteration"]
        reduces = r["fsdp"]["reduce_scatters_per_iteration"]
        trace = r.get("trace")
        traced = (
            [it["collective_counts"].get(str(CollectiveKind.REDUCE_GRADS), 0) for it in trace["per_iteration"]]
            if trace
            else None
        )
        if r["dp_rank"] == 0 and r["tp_rank"] == 0:
            report.fsdp.append(
                {
                    "derived_unshards": derived,
                    "derived_reduce_scatters": derived_reduces,
                    "traced_reduce_scatters_per_iteration": traced,
                    **r["fsdp"],
                }
            )
        if any(n != derived for n in measured):
            report.problems.append(
                f"{where}: {measured} parameter all-gathers per iteration, the lowering derived {derived}"
            )
        if any(n != derived_reduces for n in reduces) or (
            traced is not None and traced != [derived_reduces] * len(traced)
        ):
            report.problems.append(
                f"{where}: {reduces} gradient reduce-scatters per iteration (traced launches {traced}), the lowering "
                f"derived {derived_reduces}"
            )
    if report.problems:
        report.ok = False
