"""Real Transformer Engine layers, one GPU: the adapter's B/W split equals TE's own fused backward.

Skipped (with the reason) without CUDA or without a TE >= 2.10; run with ``bash scripts/run_gpu_tests.sh``.
Per layer: TE discovers it as deferring (``need_backward_dw``), B leaves every deferred weight gradient
untouched, each W computes them, and after B0 B1 W0 B2 W1 W2 every gradient equals the unsplit backward's.
"""

from __future__ import annotations

import pytest
from gpu_env import skip_reason

_reason = skip_reason(1)
if _reason is not None:
    pytest.skip(_reason, allow_module_level=True)

import torch  # noqa: E402
import transformer_engine.pytorch as te  # noqa: E402

from megatron_pp_ext.runtime.te_wgrad import deferring_modules, enable_te_wgrad, te_queue_size  # noqa: E402
from megatron_pp_ext.runtime.wgrad import WeightGradStore  # noqa: E402


def _make(layer: str, delay: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    kwargs = {"params_dtype": torch.float32, "delay_wgrad_compute": delay}
    if layer == "LayerNormMLP":
        return te.LayerNormMLP(64, 128, **kwargs).cuda()
    return getattr(te, layer)(64, 64, **kwargs).cuda()


@pytest.mark.parametrize("layer", ["Linear", "LayerNormLinear", "LayerNormMLP"])
def test_real_te_layer_split_matches_fused(layer):
    torch.backends.cuda.matmul.allow_tf32 = False
    ref, split = _make(layer, False), _make(layer, True)
    split.load_state_dict(ref.state_dict())
    assert deferring_modules(torch.nn.Sequential(ref)) == []
    assert deferring_modules(torch.nn.Sequential(split)) == [split]
    deferred = [n for n, p in split.named_parameters() if getattr(p, "skip_backward_post_hook", False)]
    assert deferred, "TE marked no parameter skip_backward_post_hook"
    gen = torch.Generator(device="cuda").manual_seed(1)
    xs = [torch.randn(8, 64, device="cuda", generator=gen) for _ in range(3)]
    for x in xs:
        ref(x).square().sum().backward()
    chunk = torch.nn.Sequential(split)
    store = WeightGradStore()
    enable_te_wgrad(store)
    params = dict(split.named_parameters())
    outs = [chunk(x) for x in xs]
    for mb, out in enumerate(outs):
        before = {n: None if params[n].grad is None else params[n].grad.clone() for n in deferred}
        with store.deferring(0, mb, enabled=True, where="gpu", model_chunk=chunk):
            out.square().sum().backward()
        for n in deferred:  # B computed no deferred weight gradient
            now = params[n].grad
            assert (now is None and before[n] is None) or torch.equal(now, before[n]), f"B computed {n}"
        assert te_queue_size(split) >= 1
        if mb:
            store.run(0, mb - 1, "gpu")
    store.run(0, len(outs) - 1, "gpu")
    store.check_empty("gpu")
    assert te_queue_size(split) == 0
    for (name, a), b in zip(ref.named_parameters(), split.parameters(), strict=True):
        assert b.grad is not None, name
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-5, atol=1e-6, msg=name)
