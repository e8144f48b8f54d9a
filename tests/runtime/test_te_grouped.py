"""megatron's grouped-GEMM experts (``TEGroupedMLP`` over TE's ``GroupedLinear``) under the B/W split, on CPU.

Real TE needs CUDA, so megatron's TE wrappers run over the stand-in (tests/runtime/te_megatron_standin.py,
te_standin.py); tests/gpu/test_te_pipeline_gpu.py runs the same with real TE where a GPU is present. Two
gloo ranks (PP = 2, EP = 1), one pool per module. The split schedules are zb-h2 and v-zb: zb-h1 runs a
rank's first W after its later ones, which TE's per-layer FIFO of deferred GEMMs cannot do (the adapter
refuses it: ``test_te_adapter.py::test_w_out_of_b_order_is_refused``).
"""

from __future__ import annotations

import torch

from megatron_pp_ext.schedules import generate

from .te_grouped_check import MEGATRON_1F1B, GroupedCase, te_grouped_check

CASE = GroupedCase()


def _merged(results: list[dict], run: str) -> tuple[list[float], dict[str, torch.Tensor], list[dict]]:
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


def test_grouped_experts_split_schedules_equal_megatron_1f1b_and_defer_to_w(pool):
    results = pool.run_fn(te_grouped_check, CASE, CASE.pp, 300)
    errors = [r for r in results if "error" in r]
    assert errors == [], errors
    ref_losses, ref_grads, ref_runs = _merged(results, MEGATRON_1F1B)
    assert len(ref_losses) == CASE.microbatches
    assert sum(r["grouped"] for r in ref_runs) == 2 * CASE.num_layers * CASE.num_experts  # fc1, fc2 per expert
    assert all(r["deferring"] == 0 for r in ref_runs)
    experts = [n for n in ref_grads if ".experts.linear_fc" in n]
    assert len(experts) == 2 * CASE.num_layers * CASE.num_experts
    for name in CASE.schedules:
        losses, grads, runs = _merged(results, name)
        # the same GEMMs in the same order per parameter (W ops run in B order): bit for bit megatron's 1F1B
        assert losses == ref_losses, name
        assert sorted(grads) == sorted(ref_grads), name
        differing = [n for n, g in ref_grads.items() if not torch.equal(g, grads[n])]
        assert differing == [], (name, differing)
        assert all(ref_grads[n].abs().sum() > 0 for n in experts), "an expert got no gradient: routing too narrow"
        # the deferral itself: two grouped linears per layer defer, B never touches an expert's main_grad,
        # every backward_dw that had an entry added to it
        assert sum(r["deferring"] for r in runs) == 2 * CASE.num_layers, name
        probes = [r["probe"] for r in runs]
        assert sum(p["b_ops"] for p in probes) == CASE.microbatches * generate(name, CASE.pp, 1).placement.num_stages
        assert sum(p["b_changed"] for p in probes) == 0, (name, probes)
        assert sum(p["w_calls"] for p in probes) == CASE.microbatches * 2 * CASE.num_layers, (name, probes)
        assert sum(p["w_unchanged"] for p in probes) == 0, (name, probes)
