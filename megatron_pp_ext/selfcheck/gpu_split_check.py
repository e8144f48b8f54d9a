"""The GPU check's B/W split checks: megatron's local-spec layers and Transformer Engine layers on a device.

Each check returns ``{"status": "pass" | "fail" | "skip", "summary": one line, "details": {...}}`` and runs in
one process (:func:`prepare_single_rank`: a process group of one rank, tensor and pipeline size 1), so that
the GPU check can run it in a subprocess of its own with a time limit.

* ``split-local``: megatron's column / row / output linears (:mod:`.split_check`, on the device) and a whole
  local-spec ``TransformerLayer`` in fp32: gradients after ``B0 B1 W0 B2 W1 W2`` equal the fused backward's
  (bitwise is reported; the pass criterion is ``verify``'s, :func:`split_verdict`), every linear weight's gradient is
  left alone by B and computed by W (W really deferred), and the runtime grad guard (:class:`GradWatch`) finds
  nothing missing.
* ``split-te``: TE's ``Linear``, ``LayerNormLinear``, ``LayerNormMLP`` and ``GroupedLinear`` with
  ``delay_wgrad_compute``, with TE's fused weight-gradient accumulation off and on, against the same layer
  undeferred; skipped with its reason where TE cannot run the split (:func:`te_support_problem`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

TE_RTOL, TE_ATOL = 1e-5, 1e-6  # tests/gpu/test_te_wgrad_gpu.py's criterion


def prepare_single_rank(device: str) -> None:
    """CPU shims (``device="cpu"``) or GPU 0 without TF32, and megatron's parallel state for one rank."""
    from ..verification.rank_setup import prepare_device, single_rank_group

    prepare_device(device)
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    single_rank_group(timeout_s=60.0)


def layer_config(hidden: int, heads: int, dtype: torch.dtype, dropout: float = 0.0) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=1,
        hidden_size=hidden,
        num_attention_heads=heads,
        use_cpu_initialization=True,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        hidden_dropout=dropout,
        attention_dropout=dropout,
        gradient_accumulation_fusion=False,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
    )


def build_layer(config: Any, device: str, dtype: torch.dtype, seed: int = 5) -> Any:
    """One local-spec ``TransformerLayer``, seeded, on ``device`` in ``dtype`` (norms included)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_layer import TransformerLayer

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    layer = TransformerLayer(config, get_gpt_layer_local_spec().submodules, layer_number=1)
    return layer.to(device=device, dtype=dtype)


def normwise_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    """``||got - exact|| / ||exact||`` in float64 (the verification criterion's distance)."""
    got, exact = got.detach().double(), exact.detach().double()
    norm = float(exact.norm())
    diff = float((got - exact).norm())
    return diff / norm if norm > 0 else (0.0 if diff == 0 else float("inf"))


def split_verdict(split: dict[str, Any], fused: dict[str, Any], exact: dict[str, Any]) -> Any:
    """The verification criterion (:mod:`..verification.criterion`) on one module's gradients: the split backward's
    distance to the float64 run within ``GROWTH`` times the fused backward's own fp32 distance. A W
    missed, doubled or computed from the wrong micro-batch moves a gradient by a whole contribution."""
    from ..verification import criterion

    ours = {(0, k): normwise_error(split[k], exact[k]) for k in exact}
    reference = {(0, k): normwise_error(fused[k], exact[k]) for k in exact}
    return criterion.judge(ours, reference)


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest element difference relative to the largest element of the reference ``b``."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30) if b.numel() else 0.0


def _grads(module: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: None if p.grad is None else p.grad.detach().clone() for n, p in module.named_parameters()}


def _changed(before: dict[str, Any], after: dict[str, Any]) -> set[str]:
    return {
        n
        for n in before
        if (before[n] is None) != (after[n] is None) or (before[n] is not None and not torch.equal(before[n], after[n]))
    }


# ---- split-local --------------------------------------------------------------------------------------
def _linear_cases(device: str, dry_run: bool) -> dict[str, Any]:
    from megatron.core.model_parallel_config import ModelParallelConfig

    from ..runtime.wgrad_hooks import install_wgrad_hooks, uninstall_wgrad_hooks
    from .split_check import LinearCase, _deferral_probe, _run

    size = {} if dry_run else {"hidden": 1024, "ffn": 4096, "seq": 256, "batch": 2}
    cases = [
        LinearCase("column", bias=True, device=device, **size),
        LinearCase("column", bias=False, device=device, **size),
        LinearCase("row", bias=True, device=device, **size),
        LinearCase("output", device=device, **size),
    ]
    config = ModelParallelConfig(
        tensor_model_parallel_size=1,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        params_dtype=torch.float32,
    )
    out: dict[str, Any] = {}
    install_wgrad_hooks()
    try:
        for case in cases:
            name = f"{case.layer}{'-bias' if case.bias and case.layer != 'output' else ''}"
            fused, split = _run(case, config, split=False), _run(case, config, split=True)
            exact = _run(dataclasses.replace(case, float64=True), config, split=False)
            verdict = split_verdict(split, fused, exact)
            probe = _deferral_probe(case)
            in_b = ["bias"] if case.layer == "row" and case.bias else []  # added after the linear (autograd, in B)
            out[name] = {
                "max_rel_diff": max(rel_diff(split[k], fused[k]) for k in fused),
                "bitwise": all(torch.equal(split[k], fused[k]) for k in fused),
                "verdict_ok": verdict.ok,
                "verdict": verdict.describe(),
                "b_computed": [n for n in probe["changed_by_b"] if n not in in_b],
                "w_missed": sorted(set(probe["params"]) - set(in_b) - set(probe["changed_by_w0"])),
            }
    finally:
        uninstall_wgrad_hooks()
    return out


def _transformer_layer(device: str, dry_run: bool, microbatches: int = 3) -> dict[str, Any]:
    from ..runtime.grad_check import GradWatch
    from ..runtime.wgrad import get_weight_grad_store
    from ..runtime.wgrad_hooks import install_wgrad_hooks, uninstall_wgrad_hooks

    h, heads, s, b = (64, 4, 32, 2) if dry_run else (1024, 16, 512, 2)
    install_wgrad_hooks()  # before building: megatron's linears pick the autograd function up at call time
    try:
        config = layer_config(h, heads, torch.float32)
        ref, layer = build_layer(config, device, torch.float32), build_layer(config, device, torch.float32)
        exact_config = layer_config(h, heads, torch.float32)  # the same seed: ref's weights, widened exactly
        exact = build_layer(exact_config, device, torch.float32).to(torch.float64)
        exact_config.params_dtype = exact_config.pipeline_dtype = torch.float64
        gen = torch.Generator().manual_seed(11)
        xs = [torch.randn(s, b, h, generator=gen).to(device) for _ in range(microbatches)]
        gos = [torch.randn(s, b, h, generator=gen).to(device) for _ in range(microbatches)]
        ref_inputs = []
        for x, go in zip(xs, gos, strict=True):
            x = x.clone().requires_grad_()
            ref(x, attention_mask=None)[0].backward(go)
            ref_inputs.append(x.grad)
        exact_inputs = []
        for x, go in zip(xs, gos, strict=True):
            x = x.double().requires_grad_()
            exact(x, attention_mask=None)[0].backward(go.double())
            exact_inputs.append(x.grad)
        store = get_weight_grad_store()
        store.check_empty("gpu check start")
        watch = GradWatch([layer])
        inputs = [x.clone().requires_grad_() for x in xs]
        outs = [layer(x, attention_mask=None)[0] for x in inputs]
        weights = sorted(n for n, _ in layer.named_parameters() if "linear_" in n and n.endswith("weight"))
        by_b: set[str] = set()
        by_w: list[set[str]] = []
        queued = []

        def w_op(k: int) -> None:
            before = _grads(layer)
            with watch.watch(0, k):
                store.run(0, k, "gpu check")
            by_w.append(_changed(before, _grads(layer)))

        for k in range(microbatches):  # B0 B1 W0 B2 W1 W2: other B's between a B and its W
            before = _grads(layer)
            with watch.watch(0, k), store.deferring(0, k, enabled=True, where="gpu check"):
                outs[k].backward(gos[k])
            by_b |= _changed(before, _grads(layer))
            queued.append(store.queued(0, k))
            if k:
                w_op(k - 1)
        w_op(microbatches - 1)
        store.check_empty("gpu check end")
        diffs = {n: rel_diff(p.grad, dict(ref.named_parameters())[n].grad) for n, p in layer.named_parameters()}
        diffs.update(
            {f"input{k}": rel_diff(x.grad, r) for k, (x, r) in enumerate(zip(inputs, ref_inputs, strict=True))}
        )
        bitwise = [n for n, p in layer.named_parameters() if torch.equal(p.grad, dict(ref.named_parameters())[n].grad)]

        def grads_of(module: Any, inputs: list[Any]) -> dict[str, Any]:
            params = {n: p.grad for n, p in module.named_parameters()}
            return {**params, **{f"input{k}": g for k, g in enumerate(inputs)}}

        verdict = split_verdict(
            grads_of(layer, [x.grad for x in inputs]), grads_of(ref, ref_inputs), grads_of(exact, exact_inputs)
        )
        return {
            "shape": {"hidden": h, "heads": heads, "seq": s, "micro_batch": b, "microbatches": microbatches},
            "max_rel_diff": max(diffs.values()),
            "verdict_ok": verdict.ok,
            "verdict": verdict.describe(),
            "worst": max(diffs, key=lambda n: diffs[n]),
            "bitwise_params": f"{len(bitwise)}/{len(diffs) - microbatches}",
            "b_computed": sorted(by_b & set(weights)),
            "w_missed": sorted({n for n in weights if not all(n in w for w in by_w)}),
            "closures_per_b": queued,
            "grad_guard": watch.problems(),
        }
    finally:
        uninstall_wgrad_hooks()


def split_local(device: str, dry_run: bool) -> dict[str, Any]:
    prepare_single_rank(device)
    linears = _linear_cases(device, dry_run)
    layer = _transformer_layer(device, dry_run)
    problems = []
    for name, r in [*linears.items(), ("transformer-layer", layer)]:
        if not r["verdict_ok"]:
            problems.append(f"{name}: gradients less exact than the fused backward's: {r['verdict']}")
        if r["b_computed"]:
            problems.append(f"{name}: B computed {r['b_computed']}")
        if r["w_missed"]:
            problems.append(f"{name}: a W missed {r['w_missed']}")
    if layer["grad_guard"]:
        problems.append(f"grad guard: {layer['grad_guard'][:3]}")
    if min(layer["closures_per_b"]) < 4:  # linear_qkv, linear_proj, linear_fc1, linear_fc2
        problems.append(f"transformer layer: {layer['closures_per_b']} W closures per B, expected >= 4")
    bitwise = all(r["bitwise"] for r in linears.values())
    summary = (
        f"{len(linears)} linears + 1 transformer layer (fp32): max rel diff "
        f"{max(r['max_rel_diff'] for r in [*linears.values(), layer]):.1e}, linears bitwise {bitwise}, "
        f"layer bitwise params {layer['bitwise_params']}, W deferred, guard "
        f"{'clean' if not layer['grad_guard'] else 'FAILED'}"
    )
    return {
        "status": "fail" if problems else "pass",
        "summary": "; ".join(problems) if problems else summary,
        "details": {"linears": linears, "transformer_layer": layer},
    }


# ---- split-te ---------------------------------------------------------------------------------------------
TE_LAYERS = ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear")


class _TEChunk(torch.nn.Module):
    """One TE layer as a model chunk (GroupedLinear takes its split sizes with the input)."""

    def __init__(self, layer: torch.nn.Module, splits: list[int] | None) -> None:
        super().__init__()
        self.layer, self.splits = layer, splits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layer(x, self.splits) if self.splits is not None else self.layer(x)
        return out[0] if isinstance(out, tuple) else out


def _te_layer(te: Any, name: str, delay: bool, fuse: bool) -> _TEChunk:
    torch.manual_seed(0)
    kw = {"params_dtype": torch.float32, "delay_wgrad_compute": delay, "fuse_wgrad_accumulation": fuse}
    splits = None
    if name == "LayerNormMLP":
        layer = te.LayerNormMLP(64, 128, **kw)
    elif name == "GroupedLinear":
        layer, splits = te.GroupedLinear(2, 64, 64, **kw), [4, 4]
    else:
        layer = getattr(te, name)(64, 64, **kw)
    chunk = _TEChunk(layer.cuda(), splits)
    if fuse:  # TE accumulates the weight gradient into main_grad (fp32), as under megatron DDP
        for p in chunk.parameters():
            p.main_grad = torch.zeros_like(p, dtype=torch.float32)
    return chunk


def _accumulators(chunk: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    out: dict[str, torch.Tensor | None] = {}
    for n, p in chunk.named_parameters():
        out[n] = None if p.grad is None else p.grad.detach().clone()
        if getattr(p, "main_grad", None) is not None:
            out[f"{n}.main_grad"] = p.main_grad.detach().clone()
    return out


def _te_case(te: Any, name: str, fuse: bool) -> dict[str, Any]:
    from ..runtime.te_wgrad import deferring_modules, enable_te_wgrad, te_queue_size
    from ..runtime.wgrad import WeightGradStore

    ref, split = _te_layer(te, name, False, fuse), _te_layer(te, name, True, fuse)
    split.load_state_dict(ref.state_dict())
    deferring = deferring_modules(split)
    deferred = [n for n, p in split.named_parameters() if getattr(p, "skip_backward_post_hook", False)]
    gen = torch.Generator(device="cuda").manual_seed(1)
    xs = [torch.randn(8, 64, device="cuda", generator=gen) for _ in range(3)]
    for x in xs:
        ref(x).square().sum().backward()
    store = WeightGradStore()
    enable_te_wgrad(store)
    outs = [split(x) for x in xs]
    b_computed: set[str] = set()
    queue_after_b = []
    for k, out in enumerate(outs):
        before = _accumulators(split)
        with store.deferring(0, k, enabled=True, where="gpu check", model_chunk=split):
            out.square().sum().backward()
        b_computed |= {n for n in _changed(before, _accumulators(split)) if n.split(".main_grad")[0] in deferred}
        queue_after_b.append(sum(te_queue_size(m) for m in deferring))
        if k:
            store.run(0, k - 1, "gpu check")
    store.run(0, len(outs) - 1, "gpu check")
    store.check_empty("gpu check")
    want, got = _accumulators(ref), _accumulators(split)
    missing = sorted(n for n in want if (want[n] is None) != (got[n] is None))
    compared = [n for n in want if want[n] is not None and got[n] is not None]
    close = all(torch.allclose(got[n], want[n], rtol=TE_RTOL, atol=TE_ATOL) for n in compared)  # type: ignore[arg-type]
    return {
        "deferring_modules": len(deferring),
        "deferred_params": deferred,
        "b_computed": sorted(b_computed),
        "te_queue_after_b": queue_after_b,
        "te_queue_left": sum(te_queue_size(m) for m in deferring),
        "missing": missing,
        "max_rel_diff": max((rel_diff(got[n], want[n]) for n in compared), default=0.0),  # type: ignore[arg-type]
        "bitwise": all(torch.equal(got[n], want[n]) for n in compared),  # type: ignore[arg-type]
        "close": close,
    }


def split_te(device: str, dry_run: bool) -> dict[str, Any]:
    from ..runtime.te_wgrad import te_support_problem

    if device != "cuda":
        return {"status": "skip", "summary": "Transformer Engine layers need CUDA", "details": {}}
    problem = te_support_problem()
    if problem is not None:
        return {"status": "skip", "summary": f"Transformer Engine cannot run the split here: {problem}", "details": {}}
    prepare_single_rank(device)
    import transformer_engine.pytorch as te  # type: ignore[import-not-found]

    cases: dict[str, Any] = {}
    problems = []
    for name in TE_LAYERS:
        for fuse in (False, True):
            key = f"{name}-fuse{int(fuse)}"
            try:  # one layer kind failing does not hide the others
                r = cases[key] = _te_case(te, name, fuse)
            except Exception as exc:
                cases[key] = {"error": f"{type(exc).__name__}: {exc}"}
                problems.append(f"{key}: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            if not r["deferring_modules"] or not r["deferred_params"]:
                problems.append(f"{key}: TE did not defer (need_backward_dw / skip_backward_post_hook)")
            if r["b_computed"] or r["missing"] or not r["close"] or r["te_queue_left"]:
                problems.append(
                    f"{key}: B computed {r['b_computed']}, missing {r['missing']}, "
                    f"rel diff {r['max_rel_diff']:.1e}, {r['te_queue_left']} TE entries left"
                )
    worst = max((c.get("max_rel_diff", 0.0) for c in cases.values()), default=0.0)
    return {
        "status": "fail" if problems else "pass",
        "summary": "; ".join(problems) if problems else f"{len(cases)} TE cases: W deferred, max rel diff {worst:.1e}",
        "details": {"cases": cases},
    }
