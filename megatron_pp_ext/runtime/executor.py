"""The one executor: runs any lowered schedule on megatron-core model chunks.

:func:`make_forward_backward_func` returns a function with the keyword signature
and return contract of the function megatron-core's ``get_forward_backward_func()``
returns. It interprets this rank's lowered program instruction by instruction:

* ``F``  runs megatron's ``forward_step`` on the op's chunk;
* ``BW`` runs megatron's ``backward_step`` (full backward);
* ``B`` / ``W`` run the split backward through the weight-gradient store;
* an ``Exchange`` posts its sends and receives (:mod:`.channels`: an op waits only for its own
  input, sends complete off the critical path);
* the collectives :mod:`~megatron_pp_ext.schedules.collectives` derives for a gap
  (data-parallel gradient reduction of a chunk after its last backward, the
  distributed optimizer's parameter gather before its first forward, FSDP
  unshard/reshard, the replica gradient sync of bidirectional placements) are
  launched when the program reaches that gap;
* an overlap pair of the schedule (DualPipe's forward-and-backward step) goes to the overlap hook of
  the chunk running its forward, if it has one (:mod:`.overlap`); otherwise its ops run one by one;
* with MoE all-to-all overlap on, the schedule's overlap pairs are marked and every ``F``, ``B``/``BW``
  and pair runs through megatron's combined forward-backward step (:mod:`.combined_step`).

Tensors move through a mailbox keyed like the lowering's messages
``(kind, consumer stage, micro-batch)``: a producer deposits its output, a send
takes it from there, a receive deposits into it, a consumer takes from it. A
local hand-off is a producer and consumer on the same rank meeting at the
mailbox. There are no schedule-specific branches here: everything a schedule
decides is in its op lists, its placement and the lowering.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..schedules.collectives import Collective, CollectiveKind
from ..schedules.ir import Op, OpKind, ScheduleError
from ..schedules.lowering import ACT, GRAD, Compute, Exchange, Message
from . import agreement, p2p
from .channels import Channels
from .combined_step import combined_pair, combined_step
from .data import MicrobatchIterator
from .embedding_sync import add_local_tied_grads, ends_on_same_rank, local_tied_pairs, without_embedding_groups
from .errors import ExecutorError
from .grad_check import GradCheckPolicy, GradWatch, watching
from .grad_sync import GradSync, per_chunk
from .overlap import OverlapStep, find_overlap_hook
from .run_plan import PlanCache, RunPlan, ScheduleSource, next_op
from .trace import NullTracer, Tracer
from .wgrad import WeightGradStore, get_weight_grad_store

logger = logging.getLogger(__name__)


def make_forward_backward_func(
    schedule_for: ScheduleSource,
    *,
    tracer_factory: Callable[[int], Tracer] | None = None,
    timeout_s: float | None = None,
    use_tags: bool = True,
    fsdp_max_unsharded: int | None = None,
    fsdp_grad_reduce_unit: int | None = None,
    replica_sync: Any = None,
    check_grads: bool = False,
    overlap_moe: bool = False,
    check_messages: bool = False,
) -> Callable[..., list[Any]]:
    """Build megatron's ``forward_backward_func`` for schedules from ``schedule_for(num_microbatches)``.

    ``fsdp_max_unsharded``: the model chunks are FSDP chunks (``unshard()`` / ``reshard()``, see
    :mod:`.fsdp`) of which at most this many are gathered at once (None: the schedule's declared
    limit, if any; 1 when it declares none). ``fsdp_grad_reduce_unit``: FSDP chunks reduce their gradients
    once per that many micro-batches (None: the schedule's declared unit, else once per iteration; a
    schedule loaded from CSV carries no declarations, so pass both then).
    ``replica_sync`` (bidirectional placements, :class:`.replica_sync.ReplicaSync`):
    ``launch(chunk)`` starts a chunk's gradient all-reduce with the other replica's copy,
    ``finish()`` waits for them.
    ``check_grads``: watch every training iteration with :mod:`.grad_check` (the first one always is).
    ``overlap_moe`` (or megatron's ``overlap_moe_expert_parallel_comm`` in the model's config): a training
    pass runs the schedule's overlapped order (:func:`~megatron_pp_ext.analysis.overlap_order.overlap_order`:
    the warm-up deepened where the pairs need it, the pairs marked) and runs each pair, and the forwards
    and backwards of its micro-batches, through megatron's combined step (:mod:`.combined_step`).
    ``check_messages`` (``--pipeline-check-messages``): every message carries a header, checked on arrival.
    Megatron's own ``grad_sync_func`` / ``param_sync_func`` (config) are launched where the
    collectives pass places them.
    Long because the function it returns restates megatron's keyword signature and hands each keyword on by name.
    """
    plans = PlanCache(schedule_for, fsdp_max_unsharded, fsdp_grad_reduce_unit, replica_sync)
    tracers: dict[int, Tracer] = {}
    grad_checks = GradCheckPolicy(every_iteration=check_grads)

    def forward_backward_func(
        *,
        forward_step_func: Callable[..., Any],
        data_iterator: Any,
        model: torch.nn.Module | list[torch.nn.Module],
        num_microbatches: int,
        seq_length: int,
        micro_batch_size: int,
        decoder_seq_length: int | None = None,
        forward_only: bool = False,
        collect_non_loss_data: bool = False,
        first_val_step: bool | None = None,
        adjust_tensor_shapes_fn: Callable[..., Any] | None = None,
        p2p_communicator: Any = None,
        pg_collection: Any = None,
        force_all_reduce: bool | None = False,
    ) -> list[Any]:
        if adjust_tensor_shapes_fn is not None:
            raise ExecutorError("adjust_tensor_shapes_fn is not supported by megatron_pp_ext schedules")
        models = list(model) if isinstance(model, list) else [model]
        pp_group, pg_collection = _groups(p2p_communicator, pg_collection)
        rank = pp_group.rank()
        from megatron.core.utils import get_model_config

        prefetch = p2p.strategy_for(pp_group).prefetches
        config = get_model_config(models[0])
        combined = not forward_only and (overlap_moe or getattr(config, "overlap_moe_expert_parallel_comm", False))
        the_plan = plans.plan(num_microbatches, rank, forward_only, config, models, prefetch, combined)
        agreement.agree_on_schedule(the_plan.lowered.schedule, pp_group, timeout_s=timeout_s)  # once per schedule
        if rank not in tracers:
            tracers[rank] = tracer_factory(rank) if tracer_factory else NullTracer()
        run = _Run(
            plan=the_plan,
            rank=rank,
            pp_group=pp_group,
            pg_collection=pg_collection,
            forward_step_func=forward_step_func,
            data_iterator=data_iterator,
            models=models,
            num_microbatches=num_microbatches,
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            decoder_seq_length=decoder_seq_length,
            forward_only=forward_only,
            collect_non_loss_data=collect_non_loss_data,
            first_val_step=first_val_step,
            force_all_reduce=bool(force_all_reduce),
            tracer=tracers[rank],
            timeout_s=p2p.timeout_from_env() if timeout_s is None else timeout_s,
            use_tags=use_tags,
            replica_sync=replica_sync,
            grad_watch=grad_checks.watcher(models, forward_only),
            combined=combined,
            check_messages=check_messages,
        )
        return run.execute()

    forward_backward_func.megatron_pp_ext = True  # type: ignore[attr-defined]
    forward_backward_func.syncs_replicas = replica_sync is not None  # type: ignore[attr-defined]
    return forward_backward_func


def _loss_ranks(placement: Any) -> int:
    """How many pipeline ranks compute losses (two under a bidirectional placement)."""
    return len({placement.rank_of(s) for s in range(placement.num_stages) if placement.is_last(s)})


def _groups(p2p_communicator: Any, pg_collection: Any) -> tuple[dist.ProcessGroup, Any]:
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel.schedules import _build_default_pg_collection
    from megatron.core.process_groups_config import ProcessGroupCollection

    if pg_collection is not None and not isinstance(pg_collection, ProcessGroupCollection):
        raise ExecutorError(
            f"megatron_pp_ext schedules support single-module pipelines only (got {type(pg_collection).__name__})"
        )
    if p2p_communicator is not None:
        pp_group = p2p_communicator.pp_group
    elif pg_collection is not None and getattr(pg_collection, "pp", None) is not None:
        pp_group = pg_collection.pp
    else:
        pp_group = parallel_state.get_pipeline_model_parallel_group()
    if pg_collection is None:
        pg_collection = _build_default_pg_collection()
    return pp_group, pg_collection


class _Run:
    """State of one call of the forward-backward function on one rank."""

    def __init__(
        self,
        *,
        plan: RunPlan,
        rank: int,
        pp_group: dist.ProcessGroup,
        pg_collection: Any,
        forward_step_func: Callable[..., Any],
        data_iterator: Any,
        models: list[torch.nn.Module],
        num_microbatches: int,
        seq_length: int,
        micro_batch_size: int,
        decoder_seq_length: int | None,
        forward_only: bool,
        collect_non_loss_data: bool,
        first_val_step: Any,
        force_all_reduce: bool,
        tracer: Tracer,
        timeout_s: float,
        use_tags: bool,
        replica_sync: Any,
        grad_watch: GradWatch | None = None,
        combined: bool = False,
        check_messages: bool = False,
    ) -> None:
        """One keyword per argument of megatron's ``forward_backward_func`` call and per executor option, typed."""
        from megatron.core.utils import get_model_config

        self.plan = plan
        self.schedule = plan.lowered.schedule
        self.placement = self.schedule.placement
        self.rank = rank
        self.pp_group = pp_group
        self.pg_collection = pg_collection
        self.models: list[torch.nn.Module] = models
        self.forward_step_func = forward_step_func
        self.num_microbatches: int = num_microbatches
        self.forward_only: bool = forward_only
        self.collect_non_loss_data: bool = collect_non_loss_data
        self.first_val_step = first_val_step
        self.force_all_reduce: bool = force_all_reduce
        self.tracer: Tracer = tracer
        self.timeout_s: float = timeout_s
        self.use_tags: bool = use_tags
        self.replica_sync: Any = replica_sync
        self.grad_watch: GradWatch | None = grad_watch
        self.combined: bool = combined  # pairs and their micro-batches' ops through megatron's combined step
        self.config = get_model_config(self.models[0])
        self.param_sync_func = per_chunk(self.config.param_sync_func, len(self.models))

        self._check_fits()
        self.local_stages = self.placement.stages_on_rank(rank)
        self.iterators = self._wrap_iterators(data_iterator)
        self.tensor_shape = self._tensor_shape(seq_length, micro_batch_size, decoder_seq_length)
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
        self.global_ranks = [dist.get_global_rank(pp_group, r) for r in range(pp_group.size())]
        self.cp_size = pg_collection.cp.size() if getattr(pg_collection, "cp", None) is not None else 1
        self.tp_group = getattr(pg_collection, "tp", None)

        self.mailbox: dict[tuple[str, int, int], torch.Tensor | None] = {}
        # sends posted ahead of their exchange (a combined step's forward output): the exchange skips them
        self.sent_early: set[Message] = set()
        self.saved: dict[tuple[int, int], tuple[Any, Any]] = {}
        self.channels = Channels(
            group=pp_group,
            global_ranks=self.global_ranks,
            timeout_s=self.timeout_s,
            use_tags=self.use_tags,
            send_bound=plan.lowered.send_bounds[rank],
            tracer=self.tracer,
            free=self._free_output,
            check_messages=check_messages,
        )
        self.forward_data_store: list[Any] = []
        self.total_num_tokens = torch.zeros([], dtype=torch.int, device=self.device)  # megatron keeps it on the GPU
        self.wgrad: WeightGradStore = get_weight_grad_store()
        self.wgrad.on_held_bytes = self.tracer.add_held_bytes
        self.grad_sync = GradSync(self.config, self.models, active=not self.forward_only, expected=self._reductions())
        self.holds_last_stage = any(self.placement.is_last(s) for s in self.local_stages)

    # ---- set-up helpers ------------------------------------------------------------------
    def _check_fits(self) -> None:
        """Refuse a pipeline group, a chunk count or a model config the schedule cannot run on."""
        if self.pp_group.size() != self.schedule.num_ranks:
            raise ExecutorError(
                f"schedule {self.schedule.name!r} is for {self.schedule.num_ranks} pipeline ranks, "
                f"the pipeline group has {self.pp_group.size()}"
            )
        stages = self.placement.stages_on_rank(self.rank)
        if len(self.models) != len(stages):
            raise ExecutorError(
                f"rank {self.rank}: schedule {self.schedule.name!r} places {len(stages)} model chunk(s) "
                f"on this rank (stages {list(stages)}), got {len(self.models)}"
            )
        if self.config.variable_seq_lengths:
            raise ExecutorError("variable_seq_lengths is not supported by megatron_pp_ext schedules yet")
        if self.config.pipeline_dtype is None:
            raise ExecutorError("TransformerConfig.pipeline_dtype must be set for pipeline communication")

    def _reductions(self) -> dict[int, int]:
        """How many gradient reductions the plan places per local chunk (the gradient sync checks the count)."""
        reductions: dict[int, int] = {}
        for items in self.plan.collectives.values():
            for c in items:
                if c.kind == CollectiveKind.REDUCE_GRADS:
                    chunk = self.placement.chunk_of(c.stage)
                    reductions[chunk] = reductions.get(chunk, 0) + 1
        return reductions

    def _wrap_iterators(self, data_iterator: Any) -> list[MicrobatchIterator | None]:
        n = len(self.models)
        if isinstance(data_iterator, list):
            if len(data_iterator) != n:
                raise ExecutorError(f"rank {self.rank}: got {len(data_iterator)} data iterators for {n} model chunks")
            iters = data_iterator
        else:
            iters = [data_iterator] * n
        wrapped: dict[int, MicrobatchIterator] = {}
        out: list[MicrobatchIterator | None] = []
        for it in iters:
            if it is None:
                out.append(None)
                continue
            if id(it) not in wrapped:  # chunks sharing one iterator share one wrapper
                wrapped[id(it)] = MicrobatchIterator(it, self.num_microbatches)
            out.append(wrapped[id(it)])
        return out

    def _tensor_shape(self, seq_length: int, micro_batch_size: int, decoder_seq_length: int | None) -> tuple:
        from megatron.core.pipeline_parallel.schedules import get_tensor_shapes

        shapes = get_tensor_shapes(
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            decoder_seq_length=decoder_seq_length,
            config=self.config,
            tp_group=self.pg_collection.tp,
            cp_group=self.pg_collection.cp,
        )
        return tuple(shapes[0])

    def _where(self, op: Op | None = None) -> str:
        what = f" at {op}" if op is not None else ""
        return f"pipeline rank {self.rank} (global {dist.get_rank()}), schedule {self.schedule.name!r}{what}"

    # ---- main loop -----------------------------------------------------------------------
    def execute(self) -> list[Any]:
        from megatron.core.pipeline_parallel.schedules import (
            clear_embedding_activation_buffer,
            finish_embedding_wgrad_compute,
        )

        config = self.config
        finalize = config.finalize_model_grads_func is not None and not self.forward_only
        embedding_module = None
        if finalize:
            embedding_module = clear_embedding_activation_buffer(config, self.models, self.holds_last_stage)
        if config.timers is not None:
            config.timers("forward-backward", log_level=1).start(barrier=config.barrier_with_L1_time)
        self.grad_sync.disable()
        self.tracer.bind(
            {
                "pp_group": self.pp_group,
                "tensor_shape": self.tensor_shape,
                "dtype": config.pipeline_dtype,
                "device": self.device,
                "num_stages": self.placement.num_stages,
                "num_microbatches": self.num_microbatches,
                "schedule": self.schedule.name,
            }
        )
        self.tracer.begin_iteration(self.forward_only)
        program = self.plan.program
        collectives = self.plan.collectives
        gap = 0
        resume = 0  # after an overlap pair run by a hook: the index of the instruction that follows it
        for index, instruction in enumerate(program):
            if index < resume:
                continue
            if isinstance(instruction, Compute):
                for collective in collectives.get(gap, ()):
                    self._collective(collective)
                resume = self._overlap_pair(index, gap)
                if resume:
                    gap += 2
                    continue
                self._compute(instruction.op)
                gap += 1
            else:
                self._exchange(instruction, next_op(program, index))
        for collective in collectives.get(gap, ()):
            self._collective(collective)
        leftover_receives = self.channels.finish()
        self.grad_sync.finish(self._where())
        if self.replica_sync is not None and not self.forward_only:
            self.replica_sync.finish()  # before finalize_model_grads reads the same buffers
        self._check_drained(leftover_receives)
        for it in self.iterators:
            if it is not None:
                it.finish_iteration()
        self.tracer.end_iteration()
        if finalize:
            finish_embedding_wgrad_compute(config, embedding_module, self.holds_last_stage, self.tp_group)
            local_ends = ends_on_same_rank(self.placement)
            if config.calculate_per_token_loss and _loss_ranks(self.placement) > 1:
                # megatron takes the token count from the last pipeline rank: give it every loss rank's
                dist.all_reduce(self.total_num_tokens, group=self.pp_group)
            config.finalize_model_grads_func(
                self.models,
                self.total_num_tokens if config.calculate_per_token_loss else None,
                pg_collection=without_embedding_groups(self.pg_collection) if local_ends else self.pg_collection,
                force_all_reduce=self.force_all_reduce,
            )
            if local_ends:
                add_local_tied_grads(local_tied_pairs(self.placement, self.rank, self.models))
        if config.timers is not None:
            config.timers("forward-backward").stop()
        return self.forward_data_store

    def _check_drained(self, leftover_receives: list[str]) -> None:
        leftovers = [k for k, v in self.mailbox.items() if v is not None] + [f"saved{k}" for k in self.saved]
        leftovers += leftover_receives
        if leftovers:
            raise ExecutorError(f"{self._where()}: tensors left over at the end of the iteration: {leftovers[:8]}")
        if not self.forward_only:
            self.wgrad.check_empty(self._where())
        if self.grad_watch is not None:
            self.grad_watch.finish(self._where())

    def _collective(self, collective: Collective) -> None:
        """Launch a derived collective (asynchronous where the implementation allows)."""
        chunk = self.placement.chunk_of(collective.stage)
        self.tracer.collective(collective)
        kind = collective.kind
        if kind == CollectiveKind.REDUCE_GRADS:
            if self.replica_sync is not None:  # derived after the chunk's replica sync: let that finish
                self.replica_sync.finish_chunk(chunk)
            self.grad_sync.reduce(chunk)
        elif kind == CollectiveKind.PARAM_SYNC:
            assert self.param_sync_func is not None
            self.param_sync_func[chunk](self.models[chunk].parameters())
        elif kind == CollectiveKind.UNSHARD:
            self.models[chunk].unshard()
        elif kind == CollectiveKind.RESHARD:
            self.models[chunk].reshard()
        elif kind == CollectiveKind.REPLICA_SYNC:
            assert self.replica_sync is not None
            self.replica_sync.launch(chunk)
        else:  # pragma: no cover - a kind added to the pass but not here
            raise ExecutorError(f"{self._where()}: no implementation for collective {collective}")

    def _compute(self, op: Op) -> None:
        self._await_inputs(op)  # waiting for data is idle time, not part of the op
        self.tracer.begin_op(op)
        if op.kind == OpKind.F:
            self._forward(op)
        else:
            with watching(self.grad_watch, self.placement.chunk_of(op.stage), op.microbatch):
                if op.kind == OpKind.W:
                    self.wgrad.run(self.placement.chunk_of(op.stage), op.microbatch, _Where(self, op))
                else:
                    self._backward(op)
        self.tracer.end_op(op)

    def _overlap_pair(self, index: int, gap: int) -> int:
        """Run the overlap pair whose first op is ``program[index]`` (op ``gap`` of the rank) through the
        overlap hook of its forward's chunk (:mod:`.overlap`) and return the index of the instruction after
        it; 0 if no pair starts there or that chunk has no hook (its ops then run one by one)."""
        pairs = self.schedule.overlap_pairs
        if not pairs or gap not in pairs[self.rank]:
            return 0
        program = self.plan.program
        end = next(k for k in range(index + 1, len(program)) if isinstance(program[k], Compute))
        first, second = program[index].op, program[end].op  # type: ignore[union-attr]
        # (the lowering receives both inputs before the pair; in between the program may only post)
        forward = first if first.kind == OpKind.F else second
        if self.combined:
            after = program[end + 1] if end + 1 < len(program) else None
            after = after if isinstance(after, Exchange) else None
            combined_pair(self, first, second, program[index + 1 : end], after, gap)  # type: ignore[arg-type]
            return end + 1
        hook = find_overlap_hook(self.models[self.placement.chunk_of(forward.stage)])
        if hook is None:
            return 0
        done: list[Op] = []

        def run_first() -> None:  # the first op, then what the program does before the second
            self._compute(first)
            for ins in program[index + 1 : end]:
                self._exchange(ins, second)  # type: ignore[arg-type]
            for collective in self.plan.collectives.get(gap + 1, ()):
                self._collective(collective)
            done.append(first)

        def run_second() -> None:
            self._compute(second)
            done.append(second)

        steps = {first: run_first, second: run_second}
        backward = second if forward is first else first
        hook(
            *(OverlapStep(op, self.models[self.placement.chunk_of(op.stage)], steps[op]) for op in (forward, backward))
        )
        if sorted(done) != sorted(steps):
            raise ExecutorError(f"{self._where(first)}: the overlap hook must run each op of the pair once, ran {done}")
        return end + 1

    def _forward(self, op: Op) -> None:
        from megatron.core.pipeline_parallel.schedules import forward_step

        if self.combined and (op.stage, op.microbatch) in self.plan.paired:
            combined_step(self, op, None)
            return
        input_tensor, iterator = self._forward_inputs(op)
        chunk = self.placement.chunk_of(op.stage)
        with self.tracer.saving(op):
            output_tensor, num_tokens = forward_step(
                self.forward_step_func,
                iterator,
                self.models[chunk],
                self.num_microbatches,
                input_tensor,
                self.forward_data_store,
                self.config,
                self.cp_size,
                collect_non_loss_data=self.collect_non_loss_data,
                checkpoint_activations_microbatch=None,
                is_first_microbatch=self._is_first_microbatch(op),
                current_microbatch=op.microbatch,
                vp_stage=chunk,
                is_last_stage=self.placement.is_last(op.stage),
            )
        self._forward_outputs(op, input_tensor, output_tensor, num_tokens)

    def _is_first_microbatch(self, op: Op) -> bool:
        from megatron.core.pipeline_parallel.schedules import check_first_val_step

        return bool(check_first_val_step(self.first_val_step, self.forward_only, op in self.plan.first_forward))

    def _forward_inputs(self, op: Op) -> tuple[Any, MicrobatchIterator | None]:
        """The forward's input activation (None on a first stage) and its chunk's iterator, set to its micro-batch."""
        input_tensor = None
        if not self.placement.is_first(op.stage):
            input_tensor = self._take((ACT, op.stage, op.microbatch), op)
        iterator = self.iterators[self.placement.chunk_of(op.stage)]
        if iterator is not None:
            iterator.current = op.microbatch
        return input_tensor, iterator

    def _forward_outputs(
        self, op: Op, input_tensor: Any, output_tensor: Any, num_tokens: Any, deposited: bool = False
    ) -> None:
        """Hand a forward's output on (``deposited``: already sent) and keep what its backward needs."""
        iterator = self.iterators[self.placement.chunk_of(op.stage)]
        if iterator is not None:
            iterator.current = None
        self.total_num_tokens += num_tokens
        nxt = self.placement.next_stage(op.stage)
        local = nxt is not None and self.placement.rank_of(nxt) == self.rank
        if nxt is not None and not deposited:
            self._deposit((ACT, nxt, op.microbatch), output_tensor, local=local)
        if not self.forward_only:
            self.saved[(op.stage, op.microbatch)] = (input_tensor, output_tensor)
            if local:  # handed over (the consumer has its own leaf); a sent output is freed once sent
                self._free_output(output_tensor)

    def _backward(self, op: Op) -> None:
        from megatron.core.pipeline_parallel.schedules import backward_step

        if self.combined and (op.stage, op.microbatch) in self.plan.paired:
            combined_step(self, None, op)
            return
        input_tensor, output_tensor, output_grad = self._backward_inputs(op)
        chunk = self.placement.chunk_of(op.stage)
        with self.wgrad.deferring(
            chunk, op.microbatch, enabled=op.kind == OpKind.B, where=_Where(self, op), model_chunk=self.models[chunk]
        ):
            input_grad = backward_step(input_tensor, output_tensor, output_grad, self.config)
        self._backward_outputs(op, input_grad)

    def _backward_inputs(self, op: Op) -> tuple[Any, Any, Any]:
        """The saved input and output of the backward's forward, and the gradient of that output."""
        if self.forward_only:
            raise ExecutorError(f"{self._where(op)}: backward op in a forward-only run")
        try:
            input_tensor, output_tensor = self.saved.pop((op.stage, op.microbatch))
        except KeyError:
            raise ExecutorError(f"{self._where(op)}: no saved forward F{op.stage}.{op.microbatch}") from None
        output_grad = None
        if not self.placement.is_last(op.stage):
            output_grad = self._take((GRAD, op.stage, op.microbatch), op)
        return input_tensor, output_tensor, output_grad

    def _backward_outputs(self, op: Op, input_grad: Any) -> None:
        self.tracer.released(op)
        prev = self.placement.prev_stage(op.stage)
        if prev is not None:
            self._deposit((GRAD, prev, op.microbatch), input_grad, local=self.placement.rank_of(prev) == self.rank)

    # ---- mailbox -------------------------------------------------------------------------
    def _deposit(self, key: tuple[str, int, int], tensor: Any, *, local: bool) -> None:
        if local and key[0] == ACT:
            # The consumer stage on this rank gets its own leaf, like a received activation.
            tensor = tensor.detach().requires_grad_()
        self.mailbox[key] = tensor

    def _take(self, key: tuple[str, int, int], op: Op) -> Any:
        if key not in self.mailbox:
            raise ExecutorError(f"{self._where(op)}: input {key[0]} for stage {key[1]} mb {key[2]} never arrived")
        self.channels.wait_input(key, _OpNote((", waited for by ", op, " (its input)")))  # (no-op once awaited)
        return self.mailbox.pop(key)

    def _exchange(self, exchange: Exchange, next_op: Op | None) -> None:
        sends = []
        for msg in exchange.sends:
            if self.sent_early and msg in self.sent_early:
                self.sent_early.remove(msg)
                continue
            tensor = self.mailbox.pop(msg.key, None)
            if tensor is None:
                raise ExecutorError(f"{self._where(next_op)}: nothing to send for {msg}")
            sends.append((msg, tensor, msg.kind == ACT and not self.forward_only))
        recvs = []
        for msg in exchange.recvs:
            buffer = torch.empty(
                self.tensor_shape, dtype=self.config.pipeline_dtype, requires_grad=msg.kind == ACT, device=self.device
            )
            self.mailbox[msg.key] = buffer
            recvs.append((msg, buffer))
        self.channels.post(sends, recvs, _ExchangeContext(self, next_op))

    def _await_inputs(self, op: Op) -> None:
        """Wait for the receive that brings ``op``'s input, and nothing else; before a backward, then
        complete the send of the output it differentiates (megatron pseudo-frees that output; by now
        its receiver has posted the receive, since the gradient it sent back has arrived)."""
        if op.kind == OpKind.W:
            return
        key = (ACT if op.kind == OpKind.F else GRAD, op.stage, op.microbatch)
        self.channels.wait_input(key, _OpNote((", waited for by ", op, " (its input)")))
        saved = self.saved.get((op.stage, op.microbatch)) if op.kind != OpKind.F else None
        if saved is not None:
            self.channels.finish_send_of(saved[1], _OpNote((", before ", op, " frees the output it sent")))

    def _free_output(self, output: Any) -> None:
        """Megatron's pseudo-free of a stage output that was handed over or sent (only grad_fn is kept)."""
        from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor

        if not self.forward_only:
            deallocate_output_tensor(output, self.config.deallocate_pipeline_outputs)


class _OpNote(tuple):  # type: ignore[type-arg]
    """``(before, op, after)``: what a wait is for, in a transfer's error message, formatted only when one is
    written. A tuple, so building it runs no Python-level code on the hot path (waits happen on every op)."""

    __slots__ = ()

    def __str__(self) -> str:
        return f"{self[0]}{self[1]}{self[2]}"


class _Where:
    """Where an op runs, for the weight-gradient store's error messages: formatted only when one is written
    (formatting it for every backward op is host time the run does not need)."""

    __slots__ = ("executor", "op")

    def __init__(self, executor: Any, op: Op) -> None:
        self.executor, self.op = executor, op

    def __str__(self) -> str:
        return str(self.executor._where(self.op))


class _ExchangeContext:
    """Where an exchange happens, for the error messages of its transfers: formatted only when one is
    written (building the text for every exchange cost more than posting a receive)."""

    __slots__ = ("executor", "next_op")

    def __init__(self, executor: Any, next_op: Op | None) -> None:
        self.executor = executor
        self.next_op = next_op

    def __str__(self) -> str:
        after = f", exchange before {self.next_op}" if self.next_op is not None else ", final exchange"
        return self.executor._where() + after


__all__ = ["ExecutorError", "ScheduleError", "make_forward_backward_func"]
