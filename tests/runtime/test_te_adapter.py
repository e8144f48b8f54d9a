"""The Transformer Engine adapter against the stand-in of TE's interface (tests/runtime/te_standin.py).

In-process checks (one process, no DDP) and real megatron DDP runs on the rank pool (TP=2 x DP=2, the
distributed optimizer's reduce-scatter, fused and unfused accumulation). Real TE needs CUDA: tests/gpu.
"""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from megatron_pp_ext.integration._patching import Patcher
from megatron_pp_ext.runtime.te_wgrad import (
    check_te_support,
    deferring_modules,
    enable_te_wgrad,
    patch_for_split,
    pending_te_entries,
    te_queue_size,
    te_support_problem,
)
from megatron_pp_ext.runtime.wgrad import WeightGradError, WeightGradStore

from . import te_standin as te
from .te_ddp_check import TEDDPCase, te_ddp_check


class _Chunk(torch.nn.Module):
    """Two TE linears, a torch LayerNorm (its gradient stays in B) and a two-entry TE MLP."""

    def __init__(self, delay: bool, megatron_wrapper: bool = False) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(3)
        w1, w2 = torch.randn(8, 4, generator=gen), torch.randn(4, 8, generator=gen)
        if megatron_wrapper:
            config = types.SimpleNamespace(delay_wgrad_compute=False)  # megatron's own flag stays off
            self.fc1: te.Linear = te.MegatronTELinear(4, 8, config=config, delay_wgrad_compute=delay, init=w1)
        else:
            self.fc1 = te.Linear(4, 8, delay_wgrad_compute=delay, init=w1)
        self.fc2 = te.Linear(8, 4, delay_wgrad_compute=delay, init=w2)
        self.norm = torch.nn.LayerNorm(4)
        self.mlp = te.LayerNormMLP(4, 6, delay_wgrad_compute=delay)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.norm(self.fc2(torch.tanh(self.fc1(x)))))


def _inputs(n: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randn(3, 4, generator=gen, requires_grad=True) for _ in range(n)]


def _grads(chunk: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: (p.grad.clone() if p.grad is not None else None) for n, p in chunk.named_parameters()}


def _reference() -> tuple[dict[str, torch.Tensor | None], list[torch.Tensor]]:
    ref = _Chunk(delay=False)
    xs = _inputs()
    for x in xs:
        ref(x).square().sum().backward()
    return _grads(ref), xs


DEFERRED = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "mlp.fc1_weight", "mlp.fc2_weight"]


def test_discovery_asks_need_backward_dw():
    assert [type(m).__name__ for m in deferring_modules(_Chunk(delay=True))] == ["Linear", "Linear", "LayerNormMLP"]
    assert deferring_modules(_Chunk(delay=False)) == []
    impostor = torch.nn.Linear(2, 2)
    impostor.delay_wgrad_compute = True  # the attribute TE does not have: not a reason to defer
    impostor.backward_dw = lambda: None
    assert deferring_modules(torch.nn.Sequential(impostor)) == []


@pytest.mark.parametrize("megatron_wrapper", [False, True])
def test_b_now_w_later_equals_the_unsplit_backward(megatron_wrapper):
    ref_grads, ref_xs = _reference()
    chunk, xs = _Chunk(delay=True, megatron_wrapper=megatron_wrapper), _inputs()
    store = WeightGradStore()
    enable_te_wgrad(store)
    outs = [chunk(x) for x in xs]
    for mb, out in enumerate(outs):  # B0 B1 W0 B2 W1 W2: other B's run between a B and its W
        with store.deferring(0, mb, enabled=True, where="test", model_chunk=chunk):
            out.square().sum().backward()
        if mb:
            store.run(0, mb - 1, "test")
    store.run(0, len(outs) - 1, "test")
    store.check_empty("test")
    assert pending_te_entries(chunk) == []
    got = _grads(chunk)
    for name, ref in ref_grads.items():
        assert ref is not None and got[name] is not None, name
        torch.testing.assert_close(got[name], ref, rtol=1e-6, atol=1e-7, msg=name)
    for a, b in zip(ref_xs, xs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=1e-7)


def test_b_computes_no_deferred_weight_gradient_and_w_computes_all():
    chunk, (x0, x1) = _Chunk(delay=True), _inputs(2)
    store = WeightGradStore()
    enable_te_wgrad(store)
    params = dict(chunk.named_parameters())
    out0, out1 = chunk(x0), chunk(x1)
    with store.deferring(0, 0, enabled=True, where="test", model_chunk=chunk):
        out0.sum().backward()
    assert all(params[n].grad is None for n in DEFERRED), "B computed a deferred weight gradient"
    assert params["norm.weight"].grad is not None  # not deferred: computed in B
    assert x0.grad is not None
    assert [te_queue_size(m) for m in (chunk.fc1, chunk.fc2, chunk.mlp)] == [1, 1, 2]
    assert store.queued(0, 0) == 1  # one closure for all TE layers of the chunk
    with store.deferring(0, 1, enabled=True, where="test", model_chunk=chunk):
        out1.sum().backward()
    assert all(params[n].grad is None for n in DEFERRED)
    store.run(0, 0, "test")
    after_w0 = _grads(chunk)
    assert all(after_w0[n] is not None and after_w0[n].abs().sum() > 0 for n in DEFERRED), "W0 left a gradient out"
    assert [te_queue_size(m) for m in (chunk.fc1, chunk.fc2, chunk.mlp)] == [1, 1, 2]
    store.run(0, 1, "test")
    after_w1 = _grads(chunk)
    assert all(not torch.equal(after_w0[n], after_w1[n]) for n in DEFERRED), "W1 added nothing"
    assert pending_te_entries(chunk) == []


def test_full_backward_op_computes_deferred_gradients_at_once():
    ref_grads, _ = _reference()
    chunk = _Chunk(delay=True)
    store = WeightGradStore()
    enable_te_wgrad(store)
    for mb, x in enumerate(_inputs()):
        with store.deferring(0, mb, enabled=False, where="test", model_chunk=chunk):  # a BW op
            chunk(x).square().sum().backward()
    assert pending_te_entries(chunk) == [] and store.pending() == []
    for name, grad in _grads(chunk).items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-6, atol=1e-7, msg=name)


def test_megatron_wrapper_alone_would_compute_nothing():
    """The failure the adapter prevents: megatron's wrapper checks its own (off) config flag."""
    chunk = _Chunk(delay=True, megatron_wrapper=True)
    chunk(_inputs(1)[0]).sum().backward()
    chunk.fc1.backward_dw()  # megatron-core 0.19.2 TELinear.backward_dw: config.delay_wgrad_compute is False
    assert chunk.fc1.weight.grad is None and te_queue_size(chunk.fc1) == 1


def test_backward_dw_that_computes_nothing_is_an_error(monkeypatch):
    chunk = _Chunk(delay=True)
    store = WeightGradStore()
    enable_te_wgrad(store)
    with store.deferring(0, 0, enabled=True, where="test", model_chunk=chunk):
        chunk(_inputs(1)[0]).sum().backward()
    monkeypatch.setattr(te.LayerNormMLP, "backward_dw", lambda self: None)  # like GroupedLinear on an empty queue
    with pytest.raises(WeightGradError, match="LayerNormMLP computed nothing"):
        store.run(0, 0, "test")


def test_w_out_of_b_order_consumes_te_fifo_in_b_order():
    """zb-h1's later ranks run their first W last (B0 B1 W1 B2 W2 W0): each W pops the oldest B's entries,
    which is all TE's FIFO allows, and the gradients end up those of the unsplit backward."""
    ref_grads, _ = _reference()
    chunk, xs = _Chunk(delay=True), _inputs()
    store = WeightGradStore()
    enable_te_wgrad(store)
    outs = [chunk(x) for x in xs]
    program = [("B", 0), ("B", 1), ("W", 1), ("B", 2), ("W", 2), ("W", 0)]
    for kind, mb in program:
        if kind == "B":
            with store.deferring(0, mb, enabled=True, where="test", model_chunk=chunk):
                outs[mb].square().sum().backward()
        else:
            store.run(0, mb, "test")
            if mb == 1:  # the first W computed micro-batch 0's weight gradients, the oldest B's
                assert [te_queue_size(m) for m in (chunk.fc1, chunk.fc2, chunk.mlp)] == [1, 1, 2]
    store.check_empty("test")
    assert pending_te_entries(chunk) == []
    got = _grads(chunk)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(got[name], ref, rtol=1e-6, atol=1e-7, msg=name)


def test_enable_is_idempotent_and_needs_deferring_modules():
    store = WeightGradStore()
    assert enable_te_wgrad(store) is enable_te_wgrad(store)
    with pytest.raises(WeightGradError, match="not installed"):
        with store.deferring(0, 0, enabled=True, where="rank 0", model_chunk=_Chunk(delay=False)):
            pass


@dataclasses.dataclass
class _DDPConfig:  # the one field of megatron's DistributedDataParallelConfig the patch sets
    delay_wgrad_compute: bool = False
    overlap_grad_reduce: bool = True


def test_patch_for_split_defers_te_layers_and_hooks_ddp_on_them():
    class FakeDDP:  # megatron-core DistributedDataParallel.__init__(config, ddp_config, module, ...)
        def __init__(self, config, ddp_config, module):
            self.ddp_config = ddp_config

    patcher = Patcher()
    patch_for_split(patcher, te.STANDIN_LAYER_CLASSES, FakeDDP)
    try:
        assert te.Linear(2, 2).need_backward_dw() and te.LayerNormMLP(2, 3).need_backward_dw()
        assert not te.Linear(2, 2, delay_wgrad_compute=False).need_backward_dw()
        assert FakeDDP(None, _DDPConfig(), None).ddp_config == _DDPConfig(delay_wgrad_compute=True)
        assert FakeDDP(None, ddp_config=_DDPConfig(), module=None).ddp_config.delay_wgrad_compute
    finally:
        patcher.restore()
    assert not te.Linear(2, 2).need_backward_dw()
    assert not FakeDDP(None, _DDPConfig(), None).ddp_config.delay_wgrad_compute


def _fake_te(**drop: bool) -> types.SimpleNamespace:
    namespace = types.SimpleNamespace(Linear=te.Linear, LayerNormMLP=te.LayerNormMLP)
    if drop.get("need_backward_dw"):
        namespace.Linear = type("Linear", (torch.nn.Module,), {"backward_dw": lambda self: None})
    return namespace


@pytest.mark.parametrize(
    ("version", "api", "problem"),
    [
        ("2.10.0", _fake_te(), None),
        ("2.18.0+cu12", _fake_te(), None),
        ("2.20.0.dev0+d0067d0", _fake_te(), None),
        ("2.9.0", _fake_te(), "Transformer Engine 2.9.0 found, the B/W split needs >= 2.10"),
        ("2.3", _fake_te(), "needs >= 2.10"),
        ("2.12.0", _fake_te(need_backward_dw=True), "Linear has no need_backward_dw"),
        ("2.12.0", types.SimpleNamespace(), "has none of Linear"),
    ],
)
def test_te_support_gate(version, api, problem):
    found = te_support_problem(version, api)
    if problem is None:
        assert found is None
        check_te_support("zb-h1", version, api)
    else:
        assert found is not None and problem in found
        with pytest.raises(WeightGradError) as info:
            check_te_support("zb-h1", version, api)
        line = str(info.value)
        assert "\n" not in line and "--transformer-impl local" in line and "unsplit schedule" in line
        assert "zb-h1" in line


# ---- megatron DDP on the rank pool -------------------------------------------------------------------
DDP_CASES = [
    TEDDPCase(tp=2, dp=2, overlap_grad_reduce=True, distributed_optimizer=False, fused=False),
    TEDDPCase(tp=2, dp=2, overlap_grad_reduce=True, distributed_optimizer=True, fused=True),
    TEDDPCase(tp=1, dp=2, overlap_grad_reduce=False, distributed_optimizer=True, fused=False),
]


@pytest.mark.parametrize(
    "case",
    DDP_CASES,
    ids=lambda c: (
        f"tp{c.tp}-dp{c.dp}-overlap{int(c.overlap_grad_reduce)}-distopt{int(c.distributed_optimizer)}"
        f"-fused{int(c.fused)}"
    ),
)
def test_split_under_megatron_ddp_equals_unsplit(pool, case):
    results = pool.run_fn(te_ddp_check, case, case.tp * case.dp, 240)
    for result in results:
        assert "error" not in result, result
        assert result["mismatched"] == [], result
        assert result["missing"] == [], result
        assert len(result["checked"]) >= 8, result
        if case.overlap_grad_reduce:  # megatron's grad-ready hook: once per parameter per micro-batch
            assert set(result["ready_counts"].values()) == {case.microbatches}, result


# ---- GroupedLinear (the experts' grouped GEMM) in one process ---------------------------------------
SPLITS = [3, 0, 4]  # tokens per expert: one expert gets none, as routing allows


def _grouped(delay: bool) -> te.GroupedLinear:
    gen = torch.Generator().manual_seed(7)
    return te.GroupedLinear(
        len(SPLITS),
        4,
        6,
        bias=False,
        delay_wgrad_compute=delay,
        init_method=lambda w: w.copy_(torch.randn(w.shape, generator=gen)),
    )


def _grouped_inputs(n: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(9)
    return [torch.randn(sum(SPLITS), 4, generator=gen, requires_grad=True) for _ in range(n)]


def test_grouped_linear_b_now_w_later_is_bitwise_the_unsplit_backward():
    ref, ref_xs = _grouped(delay=False), _grouped_inputs()
    for x in ref_xs:
        ref(x, SPLITS).square().sum().backward()
    layer, xs = _grouped(delay=True), _grouped_inputs()
    assert deferring_modules(torch.nn.Sequential(layer)) == [layer]
    store, held = WeightGradStore(), []
    store.on_held_bytes = held.append
    enable_te_wgrad(store)
    outs = [layer(x, SPLITS) for x in xs]
    for mb, out in enumerate(outs):  # B0 B1 W0 B2 W1 W2
        with store.deferring(0, mb, enabled=True, where="test", model_chunk=layer):
            out.square().sum().backward()
        if mb == 0:
            assert all(w.grad is None for w in layer.weights()), "B computed an expert's weight gradient"
            assert te_queue_size(layer) == 1 and held and held[0] > 0  # the lists of tensors are counted
        if mb:
            store.run(0, mb - 1, "test")
    store.run(0, len(outs) - 1, "test")
    store.check_empty("test")
    assert te_queue_size(layer) == 0
    for i, (got, want) in enumerate(zip(layer.weights(), ref.weights(), strict=True)):
        assert torch.equal(got.grad, want.grad), f"expert {i}"
    assert layer.weight1.grad.abs().sum() == 0 and layer.weight0.grad.abs().sum() > 0
    for x_ref, x in zip(ref_xs, xs, strict=True):
        assert torch.equal(x.grad, x_ref.grad)
