"""Rank function: megatron's ``TEGroupedMLP`` experts (grouped GEMM) over the TE stand-in, split vs megatron's 1F1B.

Each rank builds a tiny MoE GPT (megatron's MoE layer, top-2 routing, the experts megatron's
``TEGroupedMLP`` over its own ``TEColumnParallelGroupedLinear`` / ``TERowParallelGroupedLinear``, executed over
the stand-in by ``te_megatron_standin.py``) in megatron DDP and runs one training iteration per schedule on
the same weights and data:

* megatron's own ``forward_backward_pipelining_without_interleaving`` (1F1B), nothing of ours installed;
* each split schedule under our executor with the plugin's patches as ``install()`` sets them for TE
  (megatron's linears split by ``wgrad_hooks``, TE layers deferring, DDP hooking them on the module).

It returns every run's losses and ``main_grad`` by global parameter name, and what the experts' weight
gradients did: how often a B op changed an expert's ``main_grad`` (it must not: B computes input gradients
only) and how many ``backward_dw`` calls of a grouped linear left its ``main_grad`` unchanged (none may).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_pp_ext.schedules import generate
from megatron_pp_ext.verification import criterion

MEGATRON_1F1B = "megatron-1f1b"


@dataclass(frozen=True)
class GroupedCase:
    schedules: tuple[str, ...] = ("zb-h1", "v-zb")
    pp: int = 2
    microbatches: int = 4
    num_layers: int = 4  # 2 stages x 2 layers (1F1B, zb-h1), 4 stages x 1 layer (v-zb)
    num_experts: int = 4
    hidden_size: int = 32
    ep: int = 1  # expert parallelism: pp * ep ranks, the experts split over the ep data-parallel ranks

    @property
    def world(self) -> int:
        return self.pp * self.ep


def _expert_weights(chunk: Any) -> list[Any]:
    from . import te_standin as te

    return [w for m in chunk.modules() if isinstance(m, te.GroupedLinear) for w in m.weights()]


class _DeferralProbe:
    """Watches the experts' ``main_grad``: across every B op of a chunk, and across every ``backward_dw``."""

    def __init__(self, provider: Any, patcher: Any) -> None:
        from . import te_standin as te

        self.b_ops = self.b_changed = self.w_calls = self.w_unchanged = 0
        self._before: dict[int, list[Any]] = {}
        before_b, after_b = provider.before_backward, provider.after_input_grad

        def before_backward(chunk: int, microbatch: int, model_chunk: Any) -> None:
            self._before[id(model_chunk)] = [w.main_grad.clone() for w in _expert_weights(model_chunk)]
            before_b(chunk, microbatch, model_chunk)

        def after_input_grad(chunk: int, microbatch: int, model_chunk: Any, store: Any) -> None:
            after_b(chunk, microbatch, model_chunk, store)
            before = self._before.pop(id(model_chunk))
            self.b_ops += bool(before)
            now = [w.main_grad for w in _expert_weights(model_chunk)]
            self.b_changed += any(not a.equal(b) for a, b in zip(before, now, strict=True))

        provider.before_backward, provider.after_input_grad = before_backward, after_input_grad
        original_dw = te.GroupedLinear.backward_dw

        def backward_dw(layer: Any) -> None:
            before = [w.main_grad.clone() for w in layer.weights()]
            queued = layer.wgrad_store.context.qsize()
            original_dw(layer)
            if queued:
                self.w_calls += 1
                self.w_unchanged += all(a.equal(w.main_grad) for a, w in zip(before, layer.weights(), strict=True))

        te.GroupedLinear.backward_dw = backward_dw  # type: ignore[method-assign]
        patcher.on_restore(lambda: setattr(te.GroupedLinear, "backward_dw", original_dw))

    def result(self) -> dict[str, int]:
        return {
            "b_ops": self.b_ops,
            "b_changed": self.b_changed,
            "w_calls": self.w_calls,
            "w_unchanged": self.w_unchanged,
        }


def _run(case: GroupedCase, name: str, extension: Any, layer_spec: Any) -> dict[str, Any]:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_pp_ext.integration._patching import Patcher
    from megatron_pp_ext.runtime.executor import make_forward_backward_func
    from megatron_pp_ext.runtime.te_wgrad import deferring_modules, enable_te_wgrad, patch_for_split
    from megatron_pp_ext.runtime.wgrad import get_weight_grad_store
    from megatron_pp_ext.runtime.wgrad_hooks import install_wgrad_hooks, uninstall_wgrad_hooks
    from megatron_pp_ext.verification import tiny_gpt

    from . import te_standin as te

    megatron = name == MEGATRON_1F1B
    schedule = generate("1f1b" if megatron else name, case.pp, case.microbatches)
    spec = tiny_gpt.TinyGPTSpec(num_layers=case.num_layers, hidden_size=case.hidden_size, num_experts=case.num_experts)
    patcher, store, probe = Patcher(), get_weight_grad_store(), None
    patcher.replace("megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec", lambda *a, **k: layer_spec)
    if not megatron:
        install_wgrad_hooks()
        patch_for_split(patcher, te.STANDIN_LAYER_CLASSES, DistributedDataParallel)
        probe = _DeferralProbe(enable_te_wgrad(store), patcher)
    try:
        config = tiny_gpt.make_config(spec, ep=case.ep)
        chunks, layouts = tiny_gpt.build_chunks(config, spec, schedule.placement, ps.get_pipeline_model_parallel_rank())
        ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=True)
        chunks = [
            DistributedDataParallel(config=config, ddp_config=ddp_config, module=c, disable_bucketing=(i > 0))
            for i, c in enumerate(chunks)
        ]
        config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
        grad_sync = [c.start_grad_sync for c in chunks]
        config.grad_sync_func = grad_sync if len(chunks) > 1 else grad_sync[0]
        config.finalize_model_grads_func = finalize_model_grads
        for c in chunks:
            c.zero_grad_buffer()
        func = (
            get_forward_backward_func()
            if megatron
            else make_forward_backward_func(lambda m: schedule, check_grads=True)
        )
        batches = tiny_gpt.make_batches(spec, 0, case.microbatches)
        losses = tiny_gpt.run_forward_backward(func, spec, chunks, batches, chunk_list=not megatron)
        grads = {}
        ep_rank = f"@ep{ps.get_expert_model_parallel_rank()}"  # grouped weights are named by local index
        for chunk, layout in zip(chunks, layouts, strict=True):
            for pname, p in tiny_gpt._unwrap(chunk).named_parameters():
                key = tiny_gpt.global_name(pname, layout, spec.tied_embeddings) + (
                    ep_rank if ".experts." in pname else ""
                )
                grads[key] = p.main_grad.detach().clone()
        return {
            "losses": losses,
            "grads": grads,
            "deferring": sum(len(deferring_modules(c)) for c in chunks),
            "grouped": sum(len(_expert_weights(c)) for c in chunks),
            "probe": probe.result() if probe else None,
            "extension": extension.__name__,
        }
    finally:
        patcher.restore()
        if not megatron:
            uninstall_wgrad_hooks()
            store.providers.clear()


def te_grouped_check(case: GroupedCase, rank: int, init_method: str) -> dict[str, Any]:
    from megatron_pp_ext.verification.rank_setup import rank_process_group

    from .te_megatron_standin import grouped_moe_layer_spec, megatron_te_over_standin

    with rank_process_group(rank, case.world, init_method, timeout_s=120.0, pp=case.pp, ep=case.ep):
        with megatron_te_over_standin() as extension:
            layer_spec = grouped_moe_layer_spec(extension, case.num_experts)
            runs = {name: _run(case, name, extension, layer_spec) for name in (MEGATRON_1F1B, *case.schedules)}
        return {"rank": rank, "runs": runs}


def _w_in_b_order(schedule: Any) -> bool:
    """Whether every stage runs its W ops in the order of its B ops (zb-h1's later ranks do not)."""
    from megatron_pp_ext.schedules import OpKind

    for rank_ops in schedule.ops:
        for stage in {op.stage for op in rank_ops}:
            b = [op.microbatch for op in rank_ops if op.stage == stage and op.kind == OpKind.B]
            w = [op.microbatch for op in rank_ops if op.stage == stage and op.kind == OpKind.W]
            if b != w:
                return False
    return True


# ---- the verdict --------------------------------------------------------------------------------------
def _merged(
    results: list[dict[str, Any]], run: str
) -> tuple[list[float], dict[str, torch.Tensor], list[dict[str, Any]]]:
    losses: list[float] = []
    grads: dict[str, torch.Tensor] = {}
    for result in results:
        r = result["runs"][run]
        losses += r["losses"]  # only the rank with the last stage has losses
        for name, grad in r["grads"].items():
            if name in grads:  # tied embedding and output layer: finalize_model_grads made them equal
                assert torch.equal(grads[name], grad), (run, name)
            grads[name] = grad
    return losses, grads, [result["runs"][run] for result in results]


def check_results(case: GroupedCase, results: list[dict[str, Any]]) -> None:
    """The verdict on :func:`te_grouped_check`'s results (also for a run by hand at other sizes, EP = 2 say)."""
    errors = [r for r in results if "error" in r]
    assert errors == [], errors
    ref_losses, ref_grads, ref_runs = _merged(results, MEGATRON_1F1B)
    assert len(ref_losses) == case.microbatches * case.ep  # every data-parallel replica's last stage
    grouped = 2 * case.num_layers * case.num_experts  # fc1, fc2 per expert per layer, over the EP ranks
    assert sum(r["grouped"] for r in ref_runs) == grouped
    assert all(r["deferring"] == 0 for r in ref_runs)
    experts = [n for n in ref_grads if ".experts.linear_fc" in n]
    assert len(experts) == grouped
    for name in case.schedules:
        losses, grads, runs = _merged(results, name)
        # the same GEMMs in the same order per parameter (W ops run in B order): bit for bit megatron's 1F1B
        assert losses == ref_losses, name
        assert sorted(grads) == sorted(ref_grads), name
        differing = {
            n: float((g - grads[n]).norm() / g.norm()) for n, g in ref_grads.items() if not torch.equal(g, grads[n])
        }
        # experts: TE's FIFO computes their W in B order whatever the schedule: bit for bit megatron's 1F1B
        assert not [n for n in differing if n in experts], (name, differing)
        if _w_in_b_order(generate(name, case.pp, case.microbatches)):  # then every W sums in megatron's order
            assert differing == {}, (name, differing)
        # else megatron's linears sum their micro-batches' weight gradients in W order: fp32 rounding of a
        # reordered sum of m terms, (m - 1) units of rounding (criterion.py), times its GROWTH allowance
        bound = criterion.GROWTH * (case.microbatches - 1) * criterion.FP32_RESOLUTION
        assert all(e <= bound for e in differing.values()), (name, bound, differing)
        assert all(ref_grads[n].abs().sum() > 0 for n in experts), "an expert got no gradient: routing too narrow"
        # the deferral itself: two grouped linears per layer defer, B never touches an expert's main_grad,
        # every backward_dw that had an entry added to it
        assert sum(r["deferring"] for r in runs) == 2 * case.num_layers * case.ep, name
        probes = [r["probe"] for r in runs]
        stages = generate(name, case.pp, 1).placement.num_stages
        assert sum(p["b_ops"] for p in probes) == case.microbatches * stages * case.ep, (name, probes)
        assert sum(p["b_changed"] for p in probes) == 0, (name, probes)
        assert sum(p["w_calls"] for p in probes) == case.microbatches * 2 * case.num_layers * case.ep, (name, probes)
        assert sum(p["w_unchanged"] for p in probes) == 0, (name, probes)


def main() -> None:
    """By hand, other sizes: ``python -m tests.runtime.te_grouped_check --ep 2`` (EP = 2 x PP = 2, 4 ranks)."""
    import argparse

    from megatron_pp_ext.verification.rank_run import TrainingRankPool

    ap = argparse.ArgumentParser()
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--schedules", default=",".join(GroupedCase.schedules))
    args = ap.parse_args()
    case = GroupedCase(schedules=tuple(args.schedules.split(",")), ep=args.ep)
    with TrainingRankPool(case.world) as pool:
        check_results(case, pool.run_fn(te_grouped_check, case, case.world, 600))
    names = ", ".join(case.schedules)
    print(f"grouped experts, EP = {case.ep} x PP = {case.pp}: {names} agree with megatron's 1F1B (experts bitwise)")


if __name__ == "__main__":
    main()
