"""Optimizer post-validation (zero-bubble paper, section 4) around megatron-core's optimizers.

megatron-core's step synchronises every pipeline stage before any of them may update: the
gradient norm (``get_grad_norm_fp32``), the found-inf flag of loss scaling
(``MixedPrecisionOptimizer._unscale_main_grads_and_check_for_nan``) and the zero count
(``count_zeros_fp32``) are all-reduced over the optimizer's ``grad_stats_parallel_group``, which
spans the pipeline (the model-parallel group; the whole world for the distributed optimizer).

:class:`PostValidatedOptimizer` keeps megatron's optimizer and its arithmetic, but reduces those
statistics only over the ranks of the stage (the same group without its pipeline dimension) and
passes the stage-reduced state down the pipeline, stage 0 to stage p-1, point to point:

* ``step()``: stage i receives the state of stages ``0..i-1`` from stage i-1, adds its own, forwards the
  sum to stage i+1 and steps on what it has: an inf skips (final: a later stage cannot remove it);
  a partial norm that needs no clipping steps unclipped; a partial norm that would clip defers the
  step (only the last stage, whose state is complete, clips at once). Before a step that may turn
  out wrong the stage keeps a copy of what the step changes (:class:`_Snapshot`). The last stage
  sends the complete state to every other stage.
* ``validate()``: before the stage's next use of its weights (the verify driver and the executor call
  it before the next iteration's first forward; ``step()`` calls it at the latest), the stage
  receives the complete state. If it gives another step than the one taken (a clip, an inf or a
  skip found on a later stage) the stage restores its copy bitwise and redoes the step exactly as
  megatron's synchronous step would have done it.

What is reduced where (identical to megatron within a stage): the partial norm squared and the
found-inf flag are all-reduced over the stage group, the tensor-parallel group (non-distributed
optimizer) or tensor x data parallel group (distributed optimizer: it reduces statistics over its
whole instance), exactly as megatron does on those dimensions; only the pipeline dimension is
post-validated.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

PLAIN, CLIP, SKIP, DEFER = "plain", "clip", "skip", "defer"


@dataclass
class PipelineState:
    """The reduced statistics of some stages: megatron's norm squared (float32, as
    ``get_grad_norm_fp32`` sums it), found-inf flag (``MixedPrecisionOptimizer.found_inf``),
    zero count, and whether stage 0 could step unclipped (every stage then could)."""

    norm_sq: torch.Tensor  # float32, shape [1]
    found_inf: float = 0.0
    zeros: int = 0
    stage0_plain: float = 1.0

    def pack(self) -> torch.Tensor:
        # float64 holds every float32 value exactly: the chain's additions stay float32 (unpack).
        return torch.tensor(
            [float(self.norm_sq[0]), self.found_inf, float(self.zeros), self.stage0_plain], dtype=torch.float64
        )

    @staticmethod
    def unpack(message: torch.Tensor) -> PipelineState:
        return PipelineState(
            norm_sq=message[:1].to(torch.float32),
            found_inf=float(message[1]),
            zeros=int(message[2]),
            stage0_plain=float(message[3]),
        )

    def plus(self, later: PipelineState) -> PipelineState:
        """This state (stages before) combined with the next stage's, in pipeline order."""
        return PipelineState(
            norm_sq=self.norm_sq + later.norm_sq,
            found_inf=max(self.found_inf, later.found_inf),
            zeros=self.zeros + later.zeros,
            stage0_plain=self.stage0_plain,
        )


@dataclass
class PostValidationStats:
    steps: int = 0
    eager: dict[str, int] = field(default_factory=dict)  # decision taken at step(): plain/clip/skip/defer
    rollbacks: int = 0  # eager step undone (restored from the snapshot)
    redos: int = 0  # step (re)done at validation with the complete state
    validations: int = 0
    snapshot_bytes: int = 0  # largest snapshot kept
    reruns: int = (
        0  # late validation: forward-backward passes run again (pretrain(), integration/post_validation_training.py)
    )
    partial_norms: list[float] = field(default_factory=list)  # per step: norm of stages 0..i (inf: found-inf)
    complete_norms: list[float] = field(default_factory=list)  # per step, once validated: norm of all stages


class _Snapshot:
    """A bitwise copy of everything a step changes: model parameters, the optimizer's (main)
    parameters and their gradients, the optimizer state (the grad scaler is kept by the caller)."""

    def __init__(self, model_params: list[torch.Tensor], parts: list[Any]) -> None:
        seen: set[int] = set()
        self.tensors: list[tuple[torch.Tensor, torch.Tensor]] = []

        def keep(t: torch.Tensor) -> None:
            key = t.untyped_storage().data_ptr() + t.storage_offset() * t.element_size()
            if (key, t.numel()) in seen:
                return
            seen.add((key, t.numel()))  # type: ignore[arg-type]
            self.tensors.append((t, t.detach().clone()))

        for p in model_params:
            keep(p.data)
        self.grads: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        self.states: list[tuple[Any, Any, dict[str, Any] | None]] = []
        for part in parts:
            for p in part.get_parameters():
                keep(p.data)
                self.grads.append((p, None if p.grad is None else p.grad.detach().clone()))
                state = part.optimizer.state.get(p)
                self.states.append((part.optimizer, p, None if state is None else _clone(state)))

    @property
    def nbytes(self) -> int:
        total = sum(c.numel() * c.element_size() for _, c in self.tensors)
        total += sum(g.numel() * g.element_size() for _, g in self.grads if g is not None)
        for _, _, s in self.states:
            total += sum(v.numel() * v.element_size() for v in (s or {}).values() if isinstance(v, torch.Tensor))
        return total

    def restore(self) -> None:
        """Parameters and optimizer state back to their pre-step bytes; gradients back to
        what the step saw (unscaled, before clipping)."""
        for live, copy in self.tensors:
            live.copy_(copy)
        for p, g in self.grads:
            if g is None:
                p.grad = None
            elif p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
        for optimizer, p, state in self.states:
            if state is None:
                optimizer.state.pop(p, None)
            else:
                optimizer.state[p] = _clone(state)


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


def optimizer_parts(optimizer: Any) -> list[Any]:
    """The MegatronOptimizers a (Chained)Optimizer steps, in its order."""
    return list(getattr(optimizer, "chained_optimizers", None) or [optimizer])


class PostValidatedOptimizer:
    """``optimizer.step()`` without the pipeline-wide reductions; see the module docstring.

    ``optimizer``: what ``megatron.core.optimizer.get_megatron_optimizer`` returns (a ChainedOptimizer
    of FP32Optimizer / Float16OptimizerWithFloat16Params / DistributedOptimizer) or one of those.
    ``model_params``: every model parameter of this rank (their bytes are part of the snapshot).
    ``stage_group``: the optimizer's statistics group without the pipeline dimension.
    ``chain_group`` / ``chain_ranks``: a group over this rank's pipeline (global ranks by stage) used
    only for the state messages.
    """

    def __init__(
        self,
        optimizer: Any,
        model_params: list[torch.Tensor],
        stage_group: Any,
        chain_group: Any,
        chain_ranks: list[int],
    ) -> None:
        from megatron.core.optimizer.optimizer import _get_param_grad_norm_group, _is_separate_grad_norm_group

        self.inner = optimizer
        self.parts = optimizer_parts(optimizer)
        self.config = self.parts[0].config
        self.model_params = model_params
        self.stage_group = stage_group
        self.chain_group = chain_group
        self.chain_ranks = chain_ranks
        self.rank = dist.get_rank()
        self.stage = chain_ranks.index(self.rank)
        self.p = len(chain_ranks)
        self.stats = PostValidationStats()
        self._pending: dict[str, Any] | None = None
        self._sends: list[Any] = []
        self._weights_changed_somewhere = False
        self.last_validated: tuple[bool, float | None, int | None] | None = None
        # called with "step" after each step and "received" when validate() has the complete state
        self.observer: Callable[[str], None] | None = None
        for part in self.parts:
            if any(_is_separate_grad_norm_group(_get_param_grad_norm_group(p)) for p in part.get_parameters()):
                raise NotImplementedError("post-validation: parameters in a separate grad-norm group")

    # -------------------------------------------------------------------------------------------
    # megatron's reductions, over the stage group only
    # -------------------------------------------------------------------------------------------
    def _with_stage_group(self, fn: Any) -> Any:
        """Run ``fn`` with every part's statistics group narrowed to the stage group."""
        saved = [part.__dict__.get("grad_stats_parallel_group") for part in self.parts]
        try:
            for part in self.parts:
                part.grad_stats_parallel_group = self.stage_group
            return fn()
        finally:
            for part, group in zip(self.parts, saved, strict=True):
                if group is None:
                    part.__dict__.pop("grad_stats_parallel_group", None)
                else:
                    part.grad_stats_parallel_group = group

    def _local_state(self, found_inf: bool) -> PipelineState:
        """This stage's norm squared as ``get_grad_norm_fp32`` computes it before its final reduction."""
        from megatron.core.optimizer import clip_grads

        grads: list[torch.Tensor] = []
        for part in self.parts:
            if not getattr(part, "is_stub_optimizer", False) and part.get_parameters():
                grads += part.get_grads_for_grad_norm()
        norm_sq = torch.zeros(1, dtype=torch.float, device="cuda")
        if grads:
            overflow = torch.zeros(1, dtype=torch.int, device="cuda")
            norm, _ = clip_grads.multi_tensor_applier(clip_grads.l2_norm_impl, overflow, [grads], False)
            norm_sq = norm**2.0
        dist.all_reduce(norm_sq, op=dist.ReduceOp.SUM, group=self.stage_group)
        zeros = 0
        if self.config.log_num_zeros_in_grad:
            zeros = int(self._with_stage_group(lambda: sum(part.count_zeros() for part in self.parts)))
        return PipelineState(norm_sq=norm_sq.reshape(1).float(), found_inf=1.0 if found_inf else 0.0, zeros=zeros)

    # -------------------------------------------------------------------------------------------
    # decisions
    # -------------------------------------------------------------------------------------------
    def _norm(self, state: PipelineState) -> Any:
        from megatron.core.optimizer import clip_grads

        if clip_grads.multi_tensor_scale_tensor_impl is not None:  # as get_grad_norm_fp32
            return state.norm_sq.clone().pow(0.5)
        return state.norm_sq.item() ** 0.5

    def _decide(self, state: PipelineState, complete: bool) -> str:
        if state.found_inf > 0:
            return SKIP
        norm = float(self._norm(state))
        threshold = self.config.grad_norm_skip_threshold
        if math.isfinite(threshold) and norm > threshold:
            return SKIP  # the norm only grows along the pipeline: final
        if self.config.clip_grad > 0.0 and self.config.clip_grad / (norm + 1.0e-6) < 1.0:
            return CLIP if complete else DEFER
        return PLAIN

    def _apply(self, decision: str, state: PipelineState) -> bool:
        """Clip (with the state's norm) and step, as megatron's step does after its reductions."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        if decision == SKIP:
            return False
        if decision == DEFER:  # done at validation (a later inf makes the last stage report the skip)
            return True
        if decision == CLIP:
            norm = self._norm(state)
            for part in self.parts:
                params = part.get_parameters()
                if getattr(part, "is_stub_optimizer", False) or not params:
                    continue
                decoupled = bool(part.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)
                clip_grad_by_total_norm_fp32(params, part.config.clip_grad, norm, use_decoupled_grad=decoupled)
        return all([part.step_with_ready_grads() for part in self.parts])

    # -------------------------------------------------------------------------------------------
    # the step and its validation
    # -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> tuple[bool, float | None, int | None]:
        """Step eagerly on the state of stages ``0..i``; megatron's return values, from that state."""
        self.validate()  # at the latest now
        for part in self.parts:
            part.grad_norms_by_group = {}
        scalers = [(s, _clone(s.state_dict())) for s in self._scalers()]  # before prepare_grads updates them
        found_inf = self._with_stage_group(lambda: any([part.prepare_grads() for part in self.parts]))
        local = self._local_state(found_inf)
        state = local
        if self.stage > 0:
            message = torch.empty(4, dtype=torch.float64)
            dist.recv(message, src=self.chain_ranks[self.stage - 1], group=self.chain_group)
            state = PipelineState.unpack(message).plus(local)
        complete = self.stage == self.p - 1
        decision = self._decide(state, complete)
        if self.stage == 0:
            state.stage0_plain = 1.0 if decision == PLAIN else 0.0
        self.stats.steps += 1
        self.stats.partial_norms.append(math.inf if state.found_inf > 0 else float(self._norm(state)))
        self.stats.eager[decision] = self.stats.eager.get(decision, 0) + 1
        snapshot = None
        # An unclipped step may be undone (a later stage's inf, clip or skip threshold); a deferred one
        # needs its gradients after the next zero_grad. Without a loss scaler, clipping or skip threshold
        # the eager decision is always final and nothing is kept.
        if not complete and ((decision == PLAIN and self._may_change()) or decision == DEFER):
            snapshot = _Snapshot(self.model_params, self.parts)
            self.stats.snapshot_bytes = max(self.stats.snapshot_bytes, snapshot.nbytes)
        success = self._apply(decision, state)
        packed = state.pack()
        if self.observer is not None:
            self.observer("step")
        if not complete:
            self._sends.append(dist.isend(packed, dst=self.chain_ranks[self.stage + 1], group=self.chain_group))
            complete_msg = torch.empty(4, dtype=torch.float64)
            receive = dist.irecv(complete_msg, src=self.chain_ranks[-1], group=self.chain_group)
            self._pending = {
                "decision": decision,
                "scalers": scalers,
                "found_inf": state.found_inf,
                "snapshot": snapshot,
                "hyperparameters": self._hyperparameters() if snapshot is not None else None,
                "message": complete_msg,
                "receive": receive,
            }
        else:
            self._sends += [dist.isend(packed, dst=r, group=self.chain_group) for r in self.chain_ranks[:-1]]
            self.last_validated = (success, self._reported_norm(state), state.zeros if self._logs_zeros() else None)
            self.stats.validations += 1
            self.stats.complete_norms.append(self.stats.partial_norms[-1])
            self._weights_changed_somewhere = self._any_stage_changes(decision, state)
        norm = self._reported_norm(state) if decision != SKIP else None
        return success, norm, (state.zeros if self._logs_zeros() else None)

    def _any_stage_changes(self, final: str, complete: PipelineState) -> bool:
        """Whether validating this step changes the weights of some stage (the same answer on every
        stage: it depends on the complete state only). A complete clip changes stage 0 (it stepped
        unclipped or deferred); a skip changes it iff it stepped unclipped; the partial norm and inf flag
        only grow along the pipeline, so no other stage changes when stage 0 does not."""
        if self.p == 1:
            return False
        return final == CLIP or (final == SKIP and complete.stage0_plain > 0)

    def weights_changed_somewhere(self) -> bool:
        """After :meth:`validate`: whether the last validation changed some stage's weights, so that work
        done with the unvalidated weights since the step (a next iteration's forward-backward run
        before validating) must be redone. Clears the answer."""
        changed, self._weights_changed_somewhere = self._weights_changed_somewhere, False
        return changed

    def _may_change(self) -> bool:
        """Whether the complete state can ever give another step than a stage's partial one."""
        threshold = self.config.grad_norm_skip_threshold
        return bool(self._scalers()) or self.config.clip_grad > 0.0 or math.isfinite(threshold)

    def success_is_final(self) -> bool:
        """Whether the ``update_successful`` each stage's step returns is always the synchronous one: only a
        skip makes it False, and without a loss scaler (found-inf) or skip threshold nothing skips."""
        return not self._scalers() and not math.isfinite(self.config.grad_norm_skip_threshold)

    def _logs_zeros(self) -> bool:
        return bool(self.config.log_num_zeros_in_grad)

    def _reported_norm(self, state: PipelineState) -> float | None:
        return None if state.found_inf > 0 else float(self._norm(state))

    @torch.no_grad()
    def validate(self) -> bool:
        """Complete the last step with the complete state; True when this stage changed its weights
        (rolled back and/or redid the step). A no-op when nothing is pending."""
        for work in self._sends:
            work.wait()
        self._sends = []
        pending, self._pending = self._pending, None
        if pending is None:
            return False
        pending["receive"].wait()
        if self.observer is not None:
            self.observer("received")
        final_state = PipelineState.unpack(pending["message"])
        final = self._decide(final_state, complete=True)
        eager = pending["decision"]
        self.stats.validations += 1
        self.stats.complete_norms.append(math.inf if final_state.found_inf > 0 else float(self._norm(final_state)))
        changed = not ((eager == PLAIN and final == PLAIN) or (eager in (SKIP, DEFER) and final == SKIP))
        self._weights_changed_somewhere = self._any_stage_changes(final, final_state)
        success = final != SKIP
        if changed:
            snapshot = pending["snapshot"]
            assert snapshot is not None, f"post-validation: eager {eager}, final {final} without a snapshot"
            cleared = [p for p, _ in snapshot.grads if p.grad is None]  # zero_grad ran since the step
            snapshot.restore()
            if eager == PLAIN:
                self.stats.rollbacks += 1
            if final != SKIP:
                # with the learning rate (etc.) of the step, not what the scheduler set since
                later = self._hyperparameters()
                self._set_hyperparameters(pending["hyperparameters"])
                try:
                    self._apply(final, final_state)
                finally:
                    self._set_hyperparameters(later)
                self.stats.redos += 1
            for p in cleared:  # megatron DDP's backward hook would add a left-over .grad into main_grad
                p.grad = None
        if final_state.found_inf != pending["found_inf"]:
            # prepare_grads updated the scaler with this stage's partial flag: the complete one instead
            for scaler, before in pending["scalers"]:
                scaler.load_state_dict(_clone(before))
                scaler.update(final_state.found_inf > 0)
        self.last_validated = (
            success,
            self._reported_norm(final_state),
            final_state.zeros if self._logs_zeros() else None,
        )
        return changed

    def _param_groups(self) -> list[dict[str, Any]]:
        return [group for part in self.parts for group in getattr(part.optimizer, "param_groups", [])]

    def _hyperparameters(self) -> list[dict[str, Any]]:
        """Each parameter group's settings (lr, weight decay, ...): megatron's OptimizerParamScheduler
        changes them after the step, before a redo of it."""
        return [{k: v for k, v in group.items() if k != "params"} for group in self._param_groups()]

    def _set_hyperparameters(self, values: list[dict[str, Any]]) -> None:
        for group, settings in zip(self._param_groups(), values, strict=True):
            group.update(settings)

    def _scalers(self) -> list[Any]:
        return [s for s in (getattr(part, "grad_scaler", None) for part in self.parts) if s is not None]

    def finish(self) -> None:
        """Validate the last step (end of training, before checkpointing or reading the weights)."""
        self.validate()

    # megatron's optimizer interface, delegated
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def stage_statistics_group(distributed_optimizer: bool) -> Any:
    """The optimizer's statistics group without the pipeline dimension (megatron's parallel_state)."""
    from megatron.core import parallel_state as ps

    if distributed_optimizer:
        return ps.get_tensor_and_data_parallel_group(with_context_parallel=True)
    return ps.get_tensor_model_parallel_group()


def new_chain_group() -> tuple[Any, list[int]]:
    """A process group over this rank's pipeline for the state messages (collective: every rank calls
    it once; groups are created for all pipelines in the same order)."""
    from megatron.core import parallel_state as ps

    mine = dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    everyone: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    group = None
    for ranks in sorted({tuple(r) for r in everyone if r is not None}):
        g = dist.new_group(list(ranks))
        if list(ranks) == mine:
            group = g
    return group, mine


def wrap(optimizer: Any, model_params: list[torch.Tensor], distributed_optimizer: bool) -> PostValidatedOptimizer:
    group, ranks = new_chain_group()
    return PostValidatedOptimizer(optimizer, model_params, stage_statistics_group(distributed_optimizer), group, ranks)
