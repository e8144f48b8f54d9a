"""Self-check of :mod:`..runtime.fsdp` on data-parallel gloo ranks against a single-process reference.

Every rank holds a tiny GPTModel split into two chunks (embedding side, loss side) and runs them
breadth-first, as a looped schedule does on one pipeline rank: all forwards of chunk 0, then of
chunk 1, then all backwards of chunk 1, then of chunk 0, with the chunks sharded between sweeps.
Each data-parallel rank takes its own micro-batches; the reference is the unpartitioned model on
one process over all ranks' micro-batches. :func:`fsdp_check` returns measured differences,
counters and memory; ``tests/selfcheck/test_fsdp_chunk.py`` asserts on them.

Gradients and trained parameters are judged by the verification criterion (:mod:`..verification.criterion`), not
by a fixed tolerance: a float64 copy of the unpartitioned model, trained on its own gradients, is the
exact result; an fp32 copy trained on its own gradients is the noise fp32 costs on this machine; the
sharded run passes when its normwise distance to the exact result is within ``GROWTH`` times that
noise (every tensor, every iteration; the squared gradient norm used for clipping too). Both models
use the criterion's Adam (``eps = 1``, ``lr = 0.1``), so rounding stays rounding across steps.

The sharded optimizer step is checked on its own as well: an fp32 copy stepped with the sharded run's
own reduced gradients must land on the same parameters up to the rounding of Adam's element-wise
update, a derived bound (:data:`ADAM_STEP_RESOLUTION` per step).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ..verification import criterion
from ..verification.rank_setup import rank_process_group
from ..verification.tiny_gpt import TinyGPTSpec

# Adam's update of one element is ~10 rounded fp32 operations (two moment updates, bias corrections,
# sqrt, + eps, divide, * lr, subtract), each exact to 2^-24 relative, and the same formula runs on the
# shards and on the full tensors: they can differ only where the kernels evaluate it differently (a
# vectorized body vs its scalar tail, FMA or not), by at most 16 * 2^-24 = 2^-20 of the element per
# step (normwise too). Steps add, they do not compound: both copies are stepped with the same
# gradients. A step skipped, doubled or applied to a stale shard moves a parameter by lr * |update|,
# >= 1e-3 relative at the criterion's lr: 1000x beyond this after a few steps.
ADAM_STEP_RESOLUTION = 2.0**-20


@dataclass(frozen=True)
class FsdpCase:
    dp: int = 2
    microbatches: int = 3  # per data-parallel rank
    iterations: int = 1
    split_backward: bool = False  # B now, W later (runtime/wgrad_hooks)
    w_while_sharded: bool = False  # with split_backward: run W with the chunk resharded (W needs no weights)
    adam: bool = False  # optimizer step after each iteration, compare parameters
    lr: float = criterion.LR
    extra_reduce_param: str | None = None  # chunk-1 parameter all-reduced over the world group first
    skip_unshard_on_rank: int | None = None  # provoke a collective timeout
    prefetch: bool = False  # gather chunk 1 asynchronously while chunk 0's forward sweep runs
    tied: bool = False  # tied embedding, both ends on this rank: add_tied_grads_locally
    backward_while_sharded: bool = False  # driver error: chunk 0's backward sweep without unshard
    timeout_s: float = 30.0
    model: TinyGPTSpec = field(
        default_factory=lambda: TinyGPTSpec(
            num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=64, tied_embeddings=False
        )
    )


def _rel(a: Any, b: Any) -> float:
    """Normwise relative distance of ``a`` to ``b`` (computed in float64)."""
    diff = float((a.double() - b.double()).norm())
    norm = float(b.double().norm())
    return diff / norm if norm > 0 else (0.0 if diff == 0 else float("inf"))


def fsdp_check(case: FsdpCase, rank: int, init_method: str) -> dict[str, Any]:
    timeout_s = max(60.0, 2 * case.timeout_s)
    with rank_process_group(rank, case.dp, init_method, timeout_s=timeout_s, tp=1, pp=1) as dist:
        import torch

        return _run(case, rank, torch, dist)


def _run(case: FsdpCase, rank: int, torch: Any, dist: Any) -> dict[str, Any]:
    """Set up, refuse a sharded forward, then train ``case.iterations`` iterations and judge them."""
    from ..runtime.wgrad_hooks import install_wgrad_hooks, uninstall_wgrad_hooks

    if case.split_backward:
        install_wgrad_hooks()
    else:
        uninstall_wgrad_hooks()
    check = _Check(case, rank, torch, dist)
    check.sharded_forward_refused()
    if case.skip_unshard_on_rank is not None:  # one rank never joins the all-gather
        return check.timeout()
    for iteration in range(case.iterations):
        if not check.iteration(iteration):
            return check.out
    check.summary()
    if case.split_backward:
        uninstall_wgrad_hooks()
    return check.out


class _Check:
    """One rank's run: the two sharded chunks, the three unpartitioned copies, what was measured (``out``)."""

    def __init__(self, case: FsdpCase, rank: int, torch: Any, dist: Any) -> None:
        from ..runtime.fsdp import FsdpMemory, ShardedChunk
        from ..runtime.wgrad import get_weight_grad_store
        from ..schedules.placement import loop_placement
        from ..verification import tiny_gpt

        self.case, self.rank, self.torch, self.dist, self.tiny_gpt = case, rank, torch, dist, tiny_gpt
        self.spec = spec = dataclasses.replace(case.model, tied_embeddings=True) if case.tied else case.model
        self.m, self.n = case.microbatches, case.dp
        self.store = get_weight_grad_store()
        config = tiny_gpt.make_config(spec)
        modules, layouts = tiny_gpt.build_chunks(config, spec, loop_placement(1, 2), 0)
        # ``reference`` (fp32) steps with the sharded run's reduced gradients: it checks the sharded optimizer
        # step alone. ``independent`` (fp32) and ``exact`` (float64, the same initial weights widened
        # exactly) train on their own gradients: the criterion's fp32 noise and exact result.
        self.reference = tiny_gpt.build_full_model(config, spec)
        self.ref_params = dict(self.reference.named_parameters())
        self.independent = tiny_gpt.build_full_model(config, spec)
        self.ind_params = dict(self.independent.named_parameters())
        self.exact = tiny_gpt.build_full_model(config, spec).double()
        self.exact_params = dict(self.exact.named_parameters())
        self.ref_opt = self._adam(self.reference.parameters())
        self.ind_opt = self._adam(self.independent.parameters())
        self.exact_opt = self._adam(self.exact.parameters())

        self.memory = FsdpMemory()
        extra = {case.extra_reduce_param: dist.group.WORLD} if case.extra_reduce_param else None
        self.chunks = chunks = [
            ShardedChunk(modules[0], name="chunk 0", memory=self.memory, timeout_s=case.timeout_s),
            ShardedChunk(
                modules[1], name="chunk 1", memory=self.memory, timeout_s=case.timeout_s, extra_grad_reductions=extra
            ),
        ]
        self.opt = self._adam([p for c in chunks for p in c.optimizer_params()])
        self.names = [
            {n_: tiny_gpt.global_name(n_, layout, spec.tied_embeddings) for n_ in c.sharded_names()}
            for c, layout in zip(chunks, layouts, strict=True)
        ]
        self.ours_errors: dict[tuple[int, str], float] = {}  # (iteration, tensor) -> distance to the exact result
        self.fp32_errors: dict[tuple[int, str], float] = {}  # the same for the fp32 copy trained on its own
        self.out: dict[str, Any] = {
            "grad_rel": [],
            "param_rel": [],
            "param_step_bound": [],
            "unshard_calls": [],
            "counters": [],
            "problems": [],
        }

    def _adam(self, params: Any) -> Any:
        return self.torch.optim.Adam(params, lr=self.case.lr, eps=criterion.ADAM_EPS)

    def _unshard(self, i: int, calls: list[int]) -> None:
        self.chunks[i].unshard(async_op=True)
        self.chunks[i].wait_unshard()
        calls[i] += 1

    def sharded_forward_refused(self) -> None:
        """Forward while sharded must fail clearly."""
        from ..runtime.fsdp import FsdpError

        torch = self.torch
        try:
            self.chunks[0](torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long), None)
            self.out["problems"].append("forward while sharded did not raise")
        except FsdpError as exc:
            self.out["sharded_forward_error"] = str(exc)

    def timeout(self) -> dict[str, Any]:
        """The ranks that join the all-gather time out on the one that does not."""
        from ..runtime.fsdp import FsdpTimeoutError

        if self.rank == self.case.skip_unshard_on_rank:
            return self.out
        try:
            self.chunks[0].unshard()
        except FsdpTimeoutError as exc:
            self.out["timeout_error"] = str(exc)
        return self.out

    def iteration(self, iteration: int) -> bool:
        """One training iteration and its comparisons; False when the case ends the run early."""
        n, m, rank = self.n, self.m, self.rank
        batches = self.tiny_gpt.make_batches(self.spec, iteration, n * m)
        mine = batches[rank * m : (rank + 1) * m]
        calls = [0, 0]
        for c in self.chunks:
            c.start_iteration()
        self._references(batches)
        acts, inputs, losses = self._forward_sweeps(mine, calls)
        if not self._backward_sweeps(acts, inputs, losses, calls):
            return False
        self._compare_grads(iteration, calls)
        if self.case.adam:
            self._step_and_compare_params(iteration)
        return True

    def _references(self, batches: list[Any]) -> None:
        """All ranks' micro-batches on the full models."""
        torch, n, m = self.torch, self.n, self.m
        models = ((self.reference, self.ref_opt), (self.independent, self.ind_opt), (self.exact, self.exact_opt))
        for model, optimizer in models:
            optimizer.zero_grad(set_to_none=True)
            with self.tiny_gpt.float64_cross_entropy() if model is self.exact else contextlib.nullcontext():
                for b in batches:
                    per_token = model(b["tokens"], b["position_ids"], None, labels=b["labels"])
                    per_token = per_token if model is self.exact else per_token.float()
                    (torch.sum(per_token * b["loss_mask"]) / b["loss_mask"].sum() / (n * m)).backward()

    def _forward_sweeps(self, mine: list[Any], calls: list[int]) -> tuple[list[Any], list[Any], list[Any]]:
        """All forwards of chunk 0, then of chunk 1: the activations, chunk 1's inputs, the losses."""
        case, chunks, torch = self.case, self.chunks, self.torch
        self._unshard(0, calls)
        if case.prefetch:
            chunks[1].unshard(async_op=True)
            calls[1] += 1
        acts = [chunks[0](b["tokens"], b["position_ids"], None) for b in mine]
        chunks[0].reshard()
        if case.prefetch:
            chunks[1].wait_unshard()
        else:
            self._unshard(1, calls)
        inputs = [a.detach().requires_grad_() for a in acts]
        losses = []
        for x, b in zip(inputs, mine, strict=True):
            chunks[1].module.set_input_tensor(x)
            per_token = chunks[1](None, None, None, labels=b["labels"]).float()
            losses.append(torch.sum(per_token * b["loss_mask"]) / b["loss_mask"].sum() / self.m)
        chunks[1].reshard()  # between the forward and the backward sweep
        return acts, inputs, losses

    def _backward_sweeps(self, acts: list[Any], inputs: list[Any], losses: list[Any], calls: list[int]) -> bool:
        """All backwards of chunk 1, then of chunk 0 (reverse order), and the gradient reductions; False when
        the case's backward while sharded ended the run."""
        from ..runtime.fsdp import FsdpError, add_tied_grads_locally, finalize_sharded_grads

        case, chunks, torch, store, m = self.case, self.chunks, self.torch, self.store, self.m
        self._unshard(1, calls)
        for mb in reversed(range(m)):
            with store.deferring(1, mb, enabled=case.split_backward, where="test B chunk 1"):
                torch.autograd.backward(losses[mb])
        chunks[1].reshard()
        if case.split_backward:
            if not case.w_while_sharded:
                self._unshard(1, calls)  # W after the chunk was resharded and gathered again
            for mb in reversed(range(m)):
                store.run(1, mb, "test W chunk 1")
            chunks[1].reshard()
        if not case.tied:
            chunks[1].start_grad_reduce()  # overlaps chunk 0's backward
        if case.backward_while_sharded:
            try:
                torch.autograd.backward(acts[-1], inputs[-1].grad)
            except FsdpError as exc:
                self.out["sharded_backward_error"] = str(exc)
            chunks[1].finish_grad_reduce()
            return False
        self._unshard(0, calls)
        for mb in reversed(range(m)):
            with store.deferring(0, mb, enabled=case.split_backward, where="test B chunk 0"):
                torch.autograd.backward(acts[mb], inputs[mb].grad)
        if case.split_backward:
            chunks[0].reshard()
            if not case.w_while_sharded:
                self._unshard(0, calls)
            for mb in reversed(range(m)):
                store.run(0, mb, "test W chunk 0")
        chunks[0].reshard()
        if case.tied:  # the output layer's copy waited for the embedding's gradient
            add_tied_grads_locally(chunks[0], "embedding.word_embeddings.weight", chunks[1], "output_layer.weight")
            chunks[1].start_grad_reduce()
        chunks[0].start_grad_reduce()
        store.check_empty("test end of iteration")
        if case.adam:  # megatron's finalize hook: waits for both reductions, checks the end state
            finalize_sharded_grads(chunks)
        else:
            chunks[1].finish_grad_reduce()
            chunks[0].finish_grad_reduce()
            for c in chunks:
                c.end_iteration()
        return True

    def _expected_grads(self, params: dict[str, Any], mapping: dict[str, str]) -> dict[str, Any]:
        return {
            local: params[global_].grad * (self.n if local == self.case.extra_reduce_param else 1)
            for local, global_ in mapping.items()
        }

    def _compare_grads(self, iteration: int, calls: list[int]) -> None:
        """Gradients: ours and the fp32 copy's, each against the exact result; counters and storage."""
        case, chunks, out = self.case, self.chunks, self.out
        rels = []
        for i, (c, mapping) in enumerate(zip(chunks, self.names, strict=True)):
            exact_g = self._expected_grads(self.exact_params, mapping)
            fp32_g = self._expected_grads(self.ind_params, mapping)
            assert c.main_shard.grad is not None
            rels.append(_rel(c.main_shard.grad, c.shard_of(self._expected_grads(self.ref_params, mapping))))
            full = c.gather_full_grads()
            for k in full:
                self.ours_errors[(iteration, f"chunk {i} {k} grad")] = _rel(full[k], exact_g[k])
                self.fp32_errors[(iteration, f"chunk {i} {k} grad")] = _rel(fp32_g[k], exact_g[k])
        out["grad_rel"].append(max(rels))  # the shard against the full run's slice, for the report
        if not case.tied and case.extra_reduce_param is None:  # norm for clipping: shards summed over DP
            sq = sum(c.local_grad_sq_norm() for c in chunks)
            self.dist.all_reduce(sq)
            exact_sq = sum(float(p.grad.pow(2).sum()) for p in self.exact_params.values())
            fp32_sq = sum(float(p.grad.double().pow(2).sum()) for p in self.ind_params.values())
            self.ours_errors[(iteration, "grad norm^2")] = abs(float(sq) - exact_sq) / exact_sq
            self.fp32_errors[(iteration, "grad norm^2")] = abs(fp32_sq - exact_sq) / exact_sq
        out["unshard_calls"].append(calls)
        out["counters"].append([(c.counters.all_gathers, c.counters.reduce_scatters) for c in chunks])
        out["storage_freed"] = all(
            c._flat.untyped_storage().size() == 0 and not c.grad_buffer_allocated for c in chunks
        )

    def _step_and_compare_params(self, iteration: int) -> None:
        """The optimizer steps: the sharded one against the reference stepped with its gradients, both
        trained copies against the exact one, and the gathered parameters against the shards."""
        chunks, names, ref_params, exact_params = self.chunks, self.names, self.ref_params, self.exact_params
        for c, mapping in zip(chunks, names, strict=True):
            for k, g in c.gather_full_grads().items():
                ref_params[mapping[k]].grad = g
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.ref_opt.step()
        self.ind_opt.step()
        self.exact_opt.step()
        prels = []
        for i, (c, mapping) in enumerate(zip(chunks, names, strict=True)):
            full = c.gather_full_params()
            prels.append(max(_rel(full[k], ref_params[g].detach()) for k, g in mapping.items()))
            for k, g in mapping.items():
                self.ours_errors[(iteration, f"chunk {i} {k} param")] = _rel(full[k], exact_params[g].detach())
                self.fp32_errors[(iteration, f"chunk {i} {k} param")] = _rel(
                    self.ind_params[g], exact_params[g].detach()
                )
        # the gathered parameters the model computes with are the shards' values
        chunks[0].unshard()
        prels.append(
            max(_rel(p.detach(), ref_params[names[0][k]].detach()) for k, p in chunks[0].module.named_parameters())
        )
        chunks[0].reshard()
        chunks[0].counters.all_gathers -= 1  # the check's own unshard
        self.out["param_rel"].append(max(prels))
        self.out["param_step_bound"].append((iteration + 1) * ADAM_STEP_RESOLUTION)

    def summary(self) -> None:
        """The criterion's verdict, memory peaks and sizes."""
        out, chunks = self.out, self.chunks
        verdict = criterion.judge(self.ours_errors, self.fp32_errors)
        out["verdict_ok"] = verdict.ok
        out["verdict"] = verdict.describe()
        out["verdict_problems"] = verdict.problems
        out["verdict_cells"] = len(self.ours_errors)

        out["memory_peak"] = dict(self.memory.peak)
        out["memory_peak_total"] = self.memory.peak_total
        out["full_param_bytes"] = [c.full_param_bytes for c in chunks]
        out["full_grad_bytes"] = [c.full_grad_bytes for c in chunks]
        out["weight_bytes"] = [c.numel * 4 for c in chunks]
        out["shard_numel"] = [c.shard_numel for c in chunks]
        out["total_all_gathers"] = [c.counters.total_all_gathers for c in chunks]
