"""Self-check of :mod:`.fsdp` on data-parallel gloo ranks against a single-process reference.

Every rank holds a tiny GPTModel split into two chunks (embedding side, loss side) and runs them
breadth-first, as a looped schedule does on one pipeline rank: all forwards of chunk 0, then of
chunk 1, then all backwards of chunk 1, then of chunk 0, with the chunks sharded between sweeps.
Each data-parallel rank takes its own micro-batches; the reference is the unpartitioned model on
one process over all ranks' micro-batches. :func:`fsdp_check` returns measured differences,
counters and memory; ``tests/verification/test_fsdp_chunk.py`` asserts on them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .rank_setup import rank_process_group
from .tiny_gpt import TinyGPTSpec


@dataclass(frozen=True)
class FsdpCase:
    dp: int = 2
    microbatches: int = 3  # per data-parallel rank
    iterations: int = 1
    split_backward: bool = False  # B now, W later (runtime/wgrad_hooks)
    w_while_sharded: bool = False  # with split_backward: run W with the chunk resharded (W needs no weights)
    adam: bool = False  # optimizer step after each iteration, compare parameters
    lr: float = 1e-4
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
    scale = float(b.abs().max())
    return float((a - b).abs().max()) / (scale if scale > 0 else 1.0)


def fsdp_check(case: FsdpCase, rank: int, init_method: str) -> dict[str, Any]:
    timeout_s = max(60.0, 2 * case.timeout_s)
    with rank_process_group(rank, case.dp, init_method, timeout_s=timeout_s, tp=1, pp=1) as dist:
        import torch

        return _run(case, rank, torch, dist)


def _run(case: FsdpCase, rank: int, torch: Any, dist: Any) -> dict[str, Any]:
    from ..runtime.fsdp import (
        FsdpError,
        FsdpMemory,
        FsdpTimeoutError,
        ShardedChunk,
        add_tied_grads_locally,
        finalize_sharded_grads,
    )
    from ..runtime.wgrad import get_weight_grad_store
    from ..runtime.wgrad_hooks import install_wgrad_hooks, uninstall_wgrad_hooks
    from ..schedules.placement import loop_placement
    from . import tiny_gpt

    spec = dataclasses.replace(case.model, tied_embeddings=True) if case.tied else case.model
    m, n = case.microbatches, case.dp
    if case.split_backward:
        install_wgrad_hooks()
    else:
        uninstall_wgrad_hooks()
    store = get_weight_grad_store()
    config = tiny_gpt.make_config(spec)
    modules, layouts = tiny_gpt.build_chunks(config, spec, loop_placement(1, 2), 0)
    # ``reference`` computes the reference gradients at the run's parameters: its Adam steps with the
    # run's reduced gradients (so an error in the sharded optimizer step shows up bitwise, and fp32
    # re-association noise in near-zero gradients, which Adam amplifies to O(lr), cannot accumulate).
    # ``independent`` trains on its own gradients; its parameters must stay within a small fraction of lr.
    reference = tiny_gpt.build_full_model(config, spec)
    ref_params = dict(reference.named_parameters())
    ref_opt = torch.optim.Adam(reference.parameters(), lr=case.lr)
    independent = tiny_gpt.build_full_model(config, spec)
    ind_params = dict(independent.named_parameters())
    ind_opt = torch.optim.Adam(independent.parameters(), lr=case.lr)

    memory = FsdpMemory()
    extra = {case.extra_reduce_param: dist.group.WORLD} if case.extra_reduce_param else None
    chunks = [
        ShardedChunk(modules[0], name="chunk 0", memory=memory, timeout_s=case.timeout_s),
        ShardedChunk(modules[1], name="chunk 1", memory=memory, timeout_s=case.timeout_s, extra_grad_reductions=extra),
    ]
    opt = torch.optim.Adam([p for c in chunks for p in c.optimizer_params()], lr=case.lr)
    names = [
        {n_: tiny_gpt.global_name(n_, layout, spec.tied_embeddings) for n_ in c.sharded_names()}
        for c, layout in zip(chunks, layouts, strict=True)
    ]
    out: dict[str, Any] = {
        "grad_rel": [],
        "param_rel": [],
        "independent_drift_in_lr": [],
        "unshard_calls": [],
        "counters": [],
        "problems": [],
    }

    # Forward while sharded must fail clearly.
    try:
        chunks[0](torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.long), None)
        out["problems"].append("forward while sharded did not raise")
    except FsdpError as exc:
        out["sharded_forward_error"] = str(exc)

    if case.skip_unshard_on_rank is not None:  # one rank never joins the all-gather
        if rank == case.skip_unshard_on_rank:
            return out
        try:
            chunks[0].unshard()
        except FsdpTimeoutError as exc:
            out["timeout_error"] = str(exc)
        return out

    def unshard(i: int, calls: list[int]) -> None:
        chunks[i].unshard(async_op=True)
        chunks[i].wait_unshard()
        calls[i] += 1

    for iteration in range(case.iterations):
        batches = tiny_gpt.make_batches(spec, iteration, n * m)
        mine = batches[rank * m : (rank + 1) * m]
        calls = [0, 0]
        for c in chunks:
            c.start_iteration()

        # ---- reference: all ranks' micro-batches on the full model ------------------------------
        for model, optimizer in (
            ((reference, ref_opt), (independent, ind_opt)) if case.adam else ((reference, ref_opt),)
        ):
            optimizer.zero_grad(set_to_none=True)
            for b in batches:
                per_token = model(b["tokens"], b["position_ids"], None, labels=b["labels"]).float()
                (torch.sum(per_token * b["loss_mask"]) / b["loss_mask"].sum() / (n * m)).backward()

        # ---- forward sweeps ------------------------------------------------------------------------
        unshard(0, calls)
        if case.prefetch:
            chunks[1].unshard(async_op=True)
            calls[1] += 1
        acts = [chunks[0](b["tokens"], b["position_ids"], None) for b in mine]
        chunks[0].reshard()
        if case.prefetch:
            chunks[1].wait_unshard()
        else:
            unshard(1, calls)
        inputs = [a.detach().requires_grad_() for a in acts]
        losses = []
        for x, b in zip(inputs, mine, strict=True):
            chunks[1].module.set_input_tensor(x)
            per_token = chunks[1](None, None, None, labels=b["labels"]).float()
            losses.append(torch.sum(per_token * b["loss_mask"]) / b["loss_mask"].sum() / m)
        chunks[1].reshard()  # between the forward and the backward sweep

        # ---- backward sweeps (reverse order) -------------------------------------------------
        unshard(1, calls)
        for mb in reversed(range(m)):
            with store.deferring(1, mb, enabled=case.split_backward, where="test B chunk 1"):
                torch.autograd.backward(losses[mb])
        chunks[1].reshard()
        if case.split_backward:
            if not case.w_while_sharded:
                unshard(1, calls)  # W after the chunk was resharded and gathered again
            for mb in reversed(range(m)):
                store.run(1, mb, "test W chunk 1")
            chunks[1].reshard()
        if not case.tied:
            chunks[1].start_grad_reduce()  # overlaps chunk 0's backward
        if case.backward_while_sharded:
            try:
                torch.autograd.backward(acts[-1], inputs[-1].grad)
            except FsdpError as exc:
                out["sharded_backward_error"] = str(exc)
            chunks[1].finish_grad_reduce()
            return out
        unshard(0, calls)
        for mb in reversed(range(m)):
            with store.deferring(0, mb, enabled=case.split_backward, where="test B chunk 0"):
                torch.autograd.backward(acts[mb], inputs[mb].grad)
        if case.split_backward:
            chunks[0].reshard()
            if not case.w_while_sharded:
                unshard(0, calls)
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

        # ---- compare gradient shards with the reference's slices ---------------------------------
        rels = []
        for c, mapping in zip(chunks, names, strict=True):
            expected = {}
            for local, global_ in mapping.items():
                g = ref_params[global_].grad
                expected[local] = g * n if local == case.extra_reduce_param else g
            assert c.main_shard.grad is not None
            rels.append(_rel(c.main_shard.grad, c.shard_of(expected)))
            full = c.gather_full_grads()
            rels.append(max(_rel(full[k], expected[k]) for k in full))
        out["grad_rel"].append(max(rels))
        if not case.tied and case.extra_reduce_param is None:  # norm for clipping: shards summed over DP
            sq = sum(c.local_grad_sq_norm() for c in chunks)
            dist.all_reduce(sq)
            ref_sq = sum(float(p.grad.double().pow(2).sum()) for p in ref_params.values())
            out["grad_norm_rel"] = abs(float(sq) - ref_sq) / ref_sq
        out["unshard_calls"].append(calls)
        out["counters"].append([(c.counters.all_gathers, c.counters.reduce_scatters) for c in chunks])
        out["storage_freed"] = all(
            c._flat.untyped_storage().size() == 0 and not c.grad_buffer_allocated for c in chunks
        )

        if case.adam:
            for c, mapping in zip(chunks, names, strict=True):
                for k, g in c.gather_full_grads().items():
                    ref_params[mapping[k]].grad = g
            opt.step()
            opt.zero_grad(set_to_none=True)
            ref_opt.step()
            ind_opt.step()
            prels, drift = [], []
            for c, mapping in zip(chunks, names, strict=True):
                full = c.gather_full_params()
                prels.append(max(_rel(full[k], ref_params[g].detach()) for k, g in mapping.items()))
                drift.append(max(float((full[k] - ind_params[g].detach()).abs().max()) for k, g in mapping.items()))
            # the gathered parameters the model computes with are the shards' values
            chunks[0].unshard()
            prels.append(
                max(_rel(p.detach(), ref_params[names[0][k]].detach()) for k, p in chunks[0].module.named_parameters())
            )
            chunks[0].reshard()
            chunks[0].counters.all_gathers -= 1  # the check's own unshard
            out["param_rel"].append(max(prels))
            out["independent_drift_in_lr"].append(max(drift) / case.lr)

    out["memory_peak"] = dict(memory.peak)
    out["memory_peak_total"] = memory.peak_total
    out["full_param_bytes"] = [c.full_param_bytes for c in chunks]
    out["full_grad_bytes"] = [c.full_grad_bytes for c in chunks]
    out["weight_bytes"] = [c.numel * 4 for c in chunks]
    out["shard_numel"] = [c.shard_numel for c in chunks]
    out["total_all_gathers"] = [c.counters.total_all_gathers for c in chunks]
    if case.split_backward:
        uninstall_wgrad_hooks()
    return out
