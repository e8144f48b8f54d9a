"""One rank's training run of a :class:`~.run_spec.RunSpec`: what every rank process of a verification
run executes, and the pool that runs specs.

:func:`run_on_rank` sets the rank up (:mod:`.rank_setup`), builds this rank's chunks of the tiny GPT for
the schedule's placement (:mod:`.rank_model`: megatron DDP, megatron's distributed optimizer or our
FSDP, and the optimizer), trains ``spec.iterations`` iterations with our executor (``OURS``) or
megatron-core's own schedule (``NATIVE``), and returns every loss and every parameter gradient (keyed by
global parameter name, tensor-parallel rank, stage and data-parallel rank) with the trace, timings and
counters. Mode ``AB`` times megatron's function against ours instead (:mod:`megatron_pp_ext.bench.ab_timing`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import time
from collections import OrderedDict
from typing import Any

from . import rank_pool
from .rank_model import RankModel, build_rank_model, inject_inf, owned_grad_ranges
from .rank_pool import report_progress
from .rank_setup import rank_process_group
from .run_spec import AB, OURS, RunSpec

__all__ = ["TrainingRankPool", "run_on_rank"]

# Mode AB's timing loop is a benchmark's, not verify's: imported by name when a spec asks for it, so verify's
# modules do not import the benchmarks built on them.
AB_TIMING_MODULE = "megatron_pp_ext.bench.ab_timing"


def run_on_rank(spec: RunSpec, rank: int, init_method: str) -> dict[str, Any]:
    """The rank job of a verification run (``RankPool.run_fn``): set up, train, tear down."""
    from ..runtime import agreement
    from .host_staging import to_cpu

    with rank_process_group(
        rank,
        spec.world_size,
        init_method,
        timeout_s=max(30.0, spec.timeout_s),
        tp=spec.tp,
        pp=spec.pp,
        ep=spec.ep,
        device=spec.device,
        stage_p2p_through_host=spec.hooks.stage_p2p_through_host,
    ):
        agreement.set_enabled(spec.hooks.check_agreement)
        report_progress(f"rank {rank} of {spec.world_size} started")
        from . import tiny_gpt
        from .breaks import injected

        with contextlib.ExitStack() as stack:
            if spec.float64:
                stack.enter_context(tiny_gpt.float64_cross_entropy())
            stack.enter_context(injected(spec.hooks.breaks if spec.mode == OURS else ()))
            return to_cpu(_train(spec))


def _train(spec: RunSpec) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    from ..schedules.schedule import Schedule

    pp_rank = ps.get_pipeline_model_parallel_rank()
    csv_text = dict(spec.hooks.schedule_csv_overrides).get(pp_rank, spec.schedule_csv)
    schedule = Schedule.from_csv(csv_text) if csv_text else None
    model = build_rank_model(spec, schedule)
    if spec.mode == AB:
        return _ab_timing(spec, model, schedule)
    return _Training(spec, model, schedule).run()


def _ab_timing(spec: RunSpec, model: RankModel, schedule: Any) -> dict[str, Any]:
    """Mode ``AB``: megatron's function (its interleaved 1F1B with virtual stages) against ours."""
    from ..runtime.executor import make_forward_backward_func

    assert schedule is not None
    native_func = _megatron_func(spec, model, schedule)
    ab_timing = importlib.import_module(AB_TIMING_MODULE).ab_timing
    return ab_timing(spec, model.chunks, make_forward_backward_func(lambda m: schedule), native_func)


def _megatron_func(spec: RunSpec, model: RankModel, schedule: Any) -> Any:
    """megatron-core's own forward-backward function for this rank's chunks, its config set as megatron's
    training loop sets it: with several chunks its interleaved 1F1B (the virtual pipeline size set, the
    schedule's micro-batch group size); with ``spec.overlap_moe`` its combined 1F1B
    (``overlap_moe_expert_parallel_comm``, one extra warm-up micro-batch). At PP = 2 the interleaved
    schedule posts its p2p unbatched (``overlap_p2p_comm``), as Megatron-LM requires there: batched,
    a step's activation and gradient to the one peer are matched to the peer's two receives by
    posting order, and the activation lands in the gradient's buffer (``megatron_overlap_p2p``, or
    always for a training run, whose results are compared)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    config = model.config
    if spec.mode != AB:  # (mode AB's two functions share the config; ours would read the flag too)
        config.overlap_moe_expert_parallel_comm = spec.overlap_moe  # megatron asserts bf16/fp16 only at construction
    if len(model.chunks) == 1:
        return get_forward_backward_func()
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_with_interleaving

    ps.set_virtual_pipeline_model_parallel_world_size(len(model.chunks))
    config.virtual_pipeline_model_parallel_size = len(model.chunks)
    if spec.megatron_overlap_p2p or (spec.mode != AB and spec.pp == 2):
        config.batch_p2p_comm, config.overlap_p2p_comm = False, True
    from .megatron_order import megatron_interleaved_group

    config.microbatch_group_size_per_vp_stage = megatron_interleaved_group(schedule) or spec.pp
    return forward_backward_pipelining_with_interleaving


class _Training:
    """The training loop of modes ``OURS`` and ``NATIVE`` on this rank, and what it records."""

    def __init__(self, spec: RunSpec, model: RankModel, schedule: Any) -> None:
        from megatron.core import parallel_state as ps

        self.spec, self.model, self.schedule = spec, model, schedule
        self.pp_rank = ps.get_pipeline_model_parallel_rank()
        self.tp_rank = ps.get_tensor_model_parallel_rank()
        self.dp_rank = ps.get_data_parallel_rank()
        self.tracer: Any = None
        self.source: Any = None  # profile-guided re-planning: the schedule source
        self.forward_backward = self._forward_backward_func()
        self.losses: list[list[float]] = []
        self.grads: list[dict[str, Any]] = []
        self.fsdp_counts: list[list[int]] = []  # per iteration, per chunk: parameter all-gathers
        self.fsdp_reduces: list[list[int]] = []  # per iteration, per chunk: gradient reduce-scatters
        self.step_times: list[float] = []
        self.optimizer_times: list[float] = []  # seconds in optimizer.step()
        self.validation_times: list[float] = []  # post-validation: seconds validating before an iteration
        self.reruns = 0  # post-validation, late: iterations run again because validation changed the weights
        self.step_norms: list[float] = []  # megatron's optimizer: the gradient norm each step reported (inf: skipped)
        self.schedules_used: list[str] = []
        self.combined_steps: list[list[Any]] = []  # per iteration (spec.record_combined_steps)

    def _forward_backward_func(self) -> Any:
        """Our executor for the schedule (or the re-planning source), or megatron-core's own schedule."""
        from ..runtime.executor import make_forward_backward_func
        from ..runtime.trace import Tracer

        spec, model, schedule = self.spec, self.model, self.schedule
        if spec.mode != OURS:
            return _megatron_func(spec, model, schedule)
        if spec.trace:
            self.tracer = Tracer(self.pp_rank, {p.untyped_storage().data_ptr() for p in model.params})
        if spec.profile_iterations > 0:
            self.source = _replanning_source(spec, model.placement.num_ranks, self.pp_rank)
            profiler = self.source.make_tracer(self.tracer)
            return make_forward_backward_func(self.source, tracer_factory=lambda r: profiler, timeout_s=spec.timeout_s)
        assert schedule is not None, "our executor needs a schedule"
        replica_sync = None
        if model.replica_group is not None:
            from ..runtime.replica_sync import ReplicaSync

            replica_sync = ReplicaSync(model.chunks, model.replica_group)
        tracer = self.tracer
        return make_forward_backward_func(
            lambda m: schedule,
            tracer_factory=(lambda r: tracer) if tracer is not None else None,
            timeout_s=spec.timeout_s,
            use_tags=spec.p2p_tags,
            fsdp_max_unsharded=spec.fsdp_max_unsharded if spec.fsdp else None,
            fsdp_grad_reduce_unit=spec.fsdp_grad_reduce_unit if spec.fsdp else None,
            replica_sync=replica_sync,
            overlap_moe=spec.overlap_moe,
            check_messages=spec.check_messages,
        )

    def run(self) -> dict[str, Any]:
        import torch

        spec, validator = self.spec, self.model.validator
        for iteration in range(spec.iterations):
            if torch.distributed.get_rank() == 0:
                report_progress(f"iteration {iteration + 1} of {spec.iterations}")
            self._iteration(iteration)
        if validator is not None:
            validator.finish()
        return self._result()

    def _zero_grads(self) -> None:
        for c in self.model.chunks:
            if self.spec.fsdp:
                c.start_iteration()
            elif self.spec.use_ddp:
                c.zero_grad_buffer()
            else:
                c.zero_grad(set_to_none=True)

    def _iteration(self, iteration: int) -> None:
        from . import tiny_gpt

        spec, model, validator = self.spec, self.model, self.model.validator
        if validator is not None and not spec.post_validation_late:  # before these weights are used
            self._validate()
        self._zero_grads()
        m = spec.num_microbatches
        batches = tiny_gpt.make_batches(spec.model, iteration, m * spec.dp)[self.dp_rank * m : (self.dp_rank + 1) * m]
        if spec.device == "cuda":
            batches = [{k: v.cuda() for k, v in b.items()} for b in batches]
        started = time.perf_counter()
        losses = self._forward_backward(batches)
        if validator is not None and spec.post_validation_late:
            self._validate()
            if validator.weights_changed_somewhere():  # this iteration ran on weights that were undone: again
                self.reruns += 1
                for c in model.chunks:
                    c.zero_grad_buffer()
                losses = self._forward_backward(batches)
        self.step_times.append(time.perf_counter() - started)
        if self.source is not None:
            self.schedules_used.append(self.source(spec.num_microbatches).to_csv())
        self.losses.append(losses)
        if spec.forward_only:
            return
        if model.replica_group is not None and not getattr(self.forward_backward, "syncs_replicas", False):
            # The executor does not run the schedule's replica-sync collectives yet: sum the two
            # copies' gradients here, after the iteration (BitPipe without its eager overlap).
            from ..runtime.replica_sync import sync_all

            sync_all(model.placement, self.pp_rank, model.chunks, model.replica_group)
        if spec.fsdp:
            self._record_fsdp_grads()
            model.optimizer.step()
            model.optimizer.zero_grad(set_to_none=True)
            return
        self._record_grads()
        if (iteration, self.pp_rank) in spec.hooks.inject_inf:
            inject_inf(model.chunks[0], spec.use_ddp)
        stepping = time.perf_counter()
        returned = model.optimizer.step()
        self.optimizer_times.append(time.perf_counter() - stepping)
        if spec.megatron_optimizer and validator is None:  # (update_successful, grad_norm, zeros)
            self.step_norms.append(math.inf if not returned[0] else float(returned[1] or 0.0))
        model.optimizer.zero_grad(set_to_none=True)

    def _forward_backward(self, batches: list[Any]) -> list[float]:
        """One forward-backward over this iteration's micro-batches; the losses this rank computed."""
        from . import tiny_gpt

        spec = self.spec
        recording: Any = contextlib.nullcontext()
        if spec.record_combined_steps:
            from .combined_steps import recording as record_steps

            recording = record_steps(self.model.chunks)
        with recording as steps:
            losses = tiny_gpt.run_forward_backward(
                self.forward_backward,
                spec.model,
                self.model.chunks,
                batches,
                chunk_list=spec.mode == OURS,
                forward_only=spec.forward_only,
            )
        if steps is not None:
            self.combined_steps.append(steps)
        return losses

    def _validate(self) -> None:
        validating = time.perf_counter()
        self.model.validator.validate()
        self.validation_times.append(time.perf_counter() - validating)

    def _key(self, name: str, layout: Any) -> str:
        from . import tiny_gpt

        model = self.spec.model
        global_key = tiny_gpt.global_name(name, layout, model.tied_embeddings, tiny_gpt.expert_offset(model))
        return f"{global_key}#tp{self.tp_rank}#stage{layout.stage}"

    def _record_fsdp_grads(self) -> None:
        step: dict[str, Any] = {}
        chunks = self.model.chunks
        for chunk, layout in zip(chunks, self.model.layouts, strict=True):
            chunk.end_iteration()  # reduced once, resharded, nothing pending
            for name, g in chunk.gather_full_grads().items():
                step[f"{self._key(name, layout)}#dp{self.dp_rank}"] = g
        self.fsdp_counts.append([c.counters.all_gathers for c in chunks])
        self.fsdp_reduces.append([c.counters.reduce_scatters for c in chunks])
        self.grads.append(step)

    def _record_grads(self) -> None:
        from ..runtime.mtp import unused_parameters
        from . import tiny_gpt

        spec, dp_rank = self.spec, self.dp_rank
        step: dict[str, Any] = {}
        for chunk, layout in zip(self.model.chunks, self.model.layouts, strict=True):
            owned = owned_grad_ranges(chunk, dp_rank, spec.dp) if spec.distributed_optimizer else {}
            unused = unused_parameters(chunk)  # megatron never reads them (runtime/mtp.py): not the model's
            for name, p in tiny_gpt._unwrap(chunk).named_parameters():
                if id(p) in unused:
                    continue
                g = getattr(p, "main_grad", None) if spec.use_ddp else p.grad
                key = self._key(name, layout)
                if spec.distributed_optimizer:  # after the reduce-scatter only this rank's shard is reduced
                    for lo, hi in owned.get(p, ()):
                        step[f"{key}#dp{dp_rank}#{lo}:{hi}"] = g.detach().reshape(-1)[lo:hi].clone()
                    continue
                step[f"{key}#dp{dp_rank}"] = g.detach().clone()
                if spec.use_ddp:
                    p.grad = g.detach().clone()
        self.grads.append(step)

    def _result(self) -> dict[str, Any]:
        import torch

        spec, model, schedule = self.spec, self.model, self.schedule
        # micro-batch of each loss this rank reports (in the order the executor stores them)
        loss_microbatches = (
            [op.microbatch for op in schedule.ops[self.pp_rank] if op.kind == "F" and model.placement.is_last(op.stage)]
            if schedule is not None and spec.mode == OURS
            else None
        )
        source = self.source
        result: dict[str, Any] = {
            # what decides fp32 rounding here: the kernels' instruction set and the thread count
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads(),
            "pp_rank": self.pp_rank,
            "tp_rank": self.tp_rank,
            "dp_rank": self.dp_rank,
            "losses": self.losses,
            "loss_microbatches": loss_microbatches,
            "grads": self.grads if spec.keep_grads else [],
            "step_times": self.step_times,
            "step_norms": self.step_norms,
            "optimizer_times": self.optimizer_times,
            "validation_times": self.validation_times,
            "schedules_used": self.schedules_used,
            "combined_steps": self.combined_steps,
            "measured_costs": None if source is None or source.costs is None else repr(source.costs),
        }
        fsdp_memory = model.fsdp_memory
        if fsdp_memory is not None:
            result["fsdp"] = {
                "all_gathers_per_iteration": [sum(x) for x in self.fsdp_counts],
                "reduce_scatters_per_iteration": [sum(x) for x in self.fsdp_reduces],
                "peak_bytes": dict(fsdp_memory.peak),
                "peak_total_bytes": fsdp_memory.peak_total,
                "mean_bytes": {k: round(v) for k, v in fsdp_memory.mean_bytes().items()},
                "full_param_bytes_per_chunk": [c.full_param_bytes for c in model.chunks],
            }
        if self.tracer is not None:
            result["trace"] = self.tracer.summary()
        if model.validator is not None:
            result["post_validation"] = {**dataclasses.asdict(model.validator.stats), "reruns": self.reruns}
        if model.replica_group is not None or spec.keep_weights:  # final weights (a replica's copies must agree)
            if spec.distributed_optimizer:  # the last step's gathers are overlapped with a next forward: do them
                for c in model.chunks:
                    c.start_param_sync(force_sync=True)
            result["weights"] = {
                self._key(name, layout) + (f"#dp{self.dp_rank}" if spec.keep_weights else ""): p
                for chunk, layout in zip(model.chunks, model.layouts, strict=True)
                for name, p in _final_weights(chunk)
            }
        return result


def _final_weights(chunk: Any) -> list[tuple[str, Any]]:
    """A chunk's parameters after the last step (those megatron uses), by name: gathered from the shards of an
    FSDP chunk (its own parameter tensors hold no storage once resharded), copied from the module otherwise."""
    from ..runtime.mtp import unused_parameters
    from . import tiny_gpt

    if _is_sharded(chunk):
        return list(chunk.gather_full_params().items())
    unused = unused_parameters(chunk)  # never read by megatron, never updated: not a copy of the model's
    return [(name, p.detach().clone()) for name, p in tiny_gpt._unwrap(chunk).named_parameters() if id(p) not in unused]


def _is_sharded(chunk: Any) -> bool:
    from ..runtime.fsdp import ShardedChunk

    return isinstance(chunk, ShardedChunk)


def _replanning_source(spec: RunSpec, p: int, pp_rank: int = 0) -> Any:
    from ..analysis.schedule_check import validate
    from ..runtime.replan import ReplanningSource
    from ..schedules import registry
    from ..schedules.costs import Costs

    assert spec.replan_schedule is not None, "profile_iterations needs replan_schedule"
    name = spec.replan_schedule
    initial = Costs.parse(spec.replan_initial_costs) if spec.replan_initial_costs else None

    def build(m: int, costs: Any) -> Any:
        this_name = name if costs is None else dict(spec.hooks.replan_overrides).get(pp_rank, name)
        costs = costs if costs is not None else initial
        kwargs: dict[str, Any] = {"memory_limit": spec.replan_memory_limit}
        if costs is not None and this_name == name:
            kwargs["costs"] = costs
        schedule = registry.generate(this_name, p, m, **kwargs)
        validate(schedule)
        return schedule

    return ReplanningSource(build, spec.profile_iterations, log=lambda text: None)


class TrainingRankPool(rank_pool.RankPool):
    """A :class:`~.rank_pool.RankPool` that also runs training specs.

    ``references`` keeps the results of the reference runs made on this pool, by spec
    (:func:`.reference.reference_runs`): the pool's processes are one machine configuration (kernels,
    threads), so a reference run again on them repeats the same operations in the same order."""

    def __init__(
        self, size: int, grace_s: float = 15.0, on_progress: Any = None, warm_module: str | None = None
    ) -> None:
        super().__init__(size, grace_s, on_progress, warm_module)
        self.references: OrderedDict[RunSpec, list[dict[str, Any]]] = OrderedDict()

    def run(self, spec: RunSpec, wall_timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Run one training run (:func:`run_on_rank`) on ``spec.world_size`` ranks."""
        return self.run_fn(run_on_rank, spec, spec.world_size, wall_timeout_s or (spec.timeout_s * 4 + 120))

    def __enter__(self) -> TrainingRankPool:
        return self
