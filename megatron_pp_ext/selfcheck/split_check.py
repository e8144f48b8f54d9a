"""Layer-level self-checks of the B/W split, runnable on CPU ranks (tests) or GPUs (tests/gpu).

:func:`linear_split_check` builds one megatron-core linear layer, runs several
micro-batches through it twice — once with the plain fused backward, once with
B now and W later, interleaved with other micro-batches' forwards and B's — and
returns whether every input, weight and bias gradient is bitwise equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..verification.rank_setup import rank_process_group


@dataclass(frozen=True)
class LinearCase:
    layer: str  # "column" | "row" | "output" | "router" (a MoE router's gate: megatron's router_gating_linear)
    tp: int = 1
    sequence_parallel: bool = False
    bias: bool = True
    microbatches: int = 3
    seq: int = 8
    batch: int = 2
    hidden: int = 16
    ffn: int = 32
    seed: int = 7
    device: str = "cpu"  # "cuda": the layer and its tensors on the current GPU (the GPU check)
    float64: bool = False  # the same weights and data widened exactly: the GPU check's exact reference


def _layer(case: LinearCase, config: Any) -> Any:
    import torch
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    init = torch.nn.init.normal_
    if case.layer == "column":
        return ColumnParallelLinear(
            case.hidden, case.ffn, config=config, init_method=init, bias=case.bias, gather_output=False
        )
    if case.layer == "row":
        return RowParallelLinear(
            case.ffn,
            case.hidden,
            config=config,
            init_method=init,
            bias=case.bias,
            input_is_parallel=True,
            skip_bias_add=False,
        )
    if case.layer == "output":  # the GPT output layer: no bias, weight passed in (tied embeddings)
        return ColumnParallelLinear(
            case.hidden,
            case.ffn,
            config=config,
            init_method=init,
            bias=False,
            gather_output=False,
            skip_weight_param_allocation=True,
        )
    if case.layer == "router":
        return _router_gate(case)
    raise ValueError(f"unknown layer {case.layer!r}")


def _router_gate(case: LinearCase) -> Any:
    """A MoE router's gate as ``TopKRouter.gating`` runs it: ``router_gating_linear`` over a weight of
    ``ffn`` experts (and a bias, if ``case.bias``), in the input's dtype."""
    import torch
    from megatron.core.transformer.moe.moe_utils import router_gating_linear

    class RouterGate(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(case.ffn, case.hidden))
            self.bias = torch.nn.Parameter(torch.randn(case.ffn)) if case.bias else None

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
            return router_gating_linear(x, self.weight, self.bias, x.dtype), None

    return RouterGate()


def _run(case: LinearCase, config: Any, split: bool) -> dict[str, Any]:
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from ..runtime.wgrad import get_weight_grad_store

    torch.manual_seed(case.seed)
    model_parallel_cuda_manual_seed(case.seed)
    dtype = torch.float64 if case.float64 else torch.float32
    layer = _layer(case, config).to(case.device, dtype)
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    external = None
    if case.layer == "output":
        external = torch.nn.Parameter(torch.randn(case.ffn // tp, case.hidden).to(case.device, dtype))
    gen = torch.Generator().manual_seed(case.seed + 100)
    in_features = case.ffn // tp if case.layer == "row" else case.hidden
    seq_in = case.seq // tp if (case.sequence_parallel and case.layer != "row") else case.seq
    xs, gos = [], []
    for _ in range(case.microbatches):
        full = torch.randn(case.seq, case.batch, in_features * (tp if case.layer == "row" else 1), generator=gen)
        if case.layer == "row":
            x = full[..., tp_rank * in_features : (tp_rank + 1) * in_features].clone()
        elif case.sequence_parallel:
            x = full[tp_rank * seq_in : (tp_rank + 1) * seq_in].clone()
        else:
            x = full
        xs.append(x.to(case.device, dtype).requires_grad_())
    outs = []
    for x in xs:
        out, _ = layer(x, weight=external) if external is not None else layer(x)
        outs.append(out)
        gos.append(torch.randn(out.shape, generator=gen).to(case.device, dtype))
    store = get_weight_grad_store()
    if not split:
        for out, go in zip(outs, gos, strict=True):
            out.backward(go)
    else:
        # B of every micro-batch, each W one step later: other B's run in between.
        for k, (out, go) in enumerate(zip(outs, gos, strict=True)):
            with store.deferring(0, k, enabled=True, where="selfcheck"):
                out.backward(go)
            if k > 0:
                store.run(0, k - 1, "selfcheck")
        store.run(0, case.microbatches - 1, "selfcheck")
        store.check_empty("selfcheck")
    grads = {f"x{k}": x.grad.clone() for k, x in enumerate(xs)}
    for name, p in layer.named_parameters():
        grads[name] = p.grad.clone()
    if external is not None:
        grads["external_weight"] = external.grad.clone()
    return grads


def linear_split_check(case: LinearCase, rank: int, init_method: str) -> dict[str, Any]:
    """Run on every rank of a ``case.tp``-rank world; returns the comparison."""
    with rank_process_group(rank, case.tp, init_method, timeout_s=60.0, tp=case.tp, backend="auto"):
        import torch
        from megatron.core.model_parallel_config import ModelParallelConfig

        from ..runtime.wgrad_hooks import install_wgrad_hooks, uninstall_wgrad_hooks

        config = ModelParallelConfig(
            tensor_model_parallel_size=case.tp,
            sequence_parallel=case.sequence_parallel,
            use_cpu_initialization=True,
            gradient_accumulation_fusion=False,
            params_dtype=torch.float32,
        )
        install_wgrad_hooks()
        fused = _run(case, config, split=False)
        split = _run(case, config, split=True)
        uninstall_wgrad_hooks()
        mismatched = sorted(k for k in fused if not torch.equal(fused[k], split[k]))
        return {"rank": rank, "checked": sorted(fused), "mismatched": mismatched}


def _deferral_probe(case: LinearCase) -> dict[str, Any]:
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from ..runtime.wgrad import get_weight_grad_store

    torch.manual_seed(case.seed)
    model_parallel_cuda_manual_seed(case.seed)

    config = ModelParallelConfig(
        tensor_model_parallel_size=case.tp,
        sequence_parallel=case.sequence_parallel,
        use_cpu_initialization=True,
        gradient_accumulation_fusion=False,
        params_dtype=torch.float32,
    )
    layer = _layer(case, config).to(case.device)
    tp = ps.get_tensor_model_parallel_world_size()
    params = dict(layer.named_parameters())
    external = None
    if case.layer == "output":
        external = torch.nn.Parameter(torch.randn(case.ffn // tp, case.hidden).to(case.device))
        params["external_weight"] = external
    in_features = case.ffn // tp if case.layer == "row" else case.hidden
    seq_in = case.seq // tp if (case.sequence_parallel and case.layer != "row") else case.seq
    outs = []
    for _ in range(2):
        x = torch.randn(seq_in, case.batch, in_features).to(case.device).requires_grad_()
        out, _ = layer(x, weight=external) if external is not None else layer(x)
        outs.append(out)
    store = get_weight_grad_store()  # the store the hooked layers queue into
    store.check_empty("probe start")
    try:

        def snapshot() -> dict[str, Any]:
            return {n: (p.grad.clone() if p.grad is not None else None) for n, p in params.items()}

        def changed(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
            return sorted(
                n for n in a if (a[n] is None) != (b[n] is None) or (a[n] is not None and not torch.equal(a[n], b[n]))
            )

        start = snapshot()
        with store.deferring(0, 0, enabled=True, where="probe"):
            outs[0].sum().backward()
        after_b0 = snapshot()
        queued_b0 = store.queued(0, 0)
        with store.deferring(0, 1, enabled=True, where="probe"):
            outs[1].sum().backward()
        after_b1 = snapshot()
        store.run(0, 0, "probe")
        after_w0 = snapshot()
        store.run(0, 1, "probe")
        after_w1 = snapshot()
    finally:
        store.check_empty("probe")
    return {
        "params": sorted(params),
        "changed_by_b": sorted(set(changed(start, after_b0)) | set(changed(after_b0, after_b1))),
        "queued_per_b": queued_b0,
        "changed_by_w0": changed(after_b1, after_w0),
        "changed_by_w1": changed(after_w0, after_w1),
    }


def linear_deferral_probe(case: LinearCase, rank: int, init_method: str) -> dict[str, Any]:
    """Which weight gradients a B and a W of a hooked megatron linear changed (B: none; each W: all)."""
    with rank_process_group(rank, case.tp, init_method, timeout_s=60.0, tp=case.tp, backend="auto"):
        from ..runtime.wgrad_hooks import install_wgrad_hooks, uninstall_wgrad_hooks

        install_wgrad_hooks()
        try:
            return {"rank": rank, **_deferral_probe(case)}
        finally:
            uninstall_wgrad_hooks()


@dataclass(frozen=True)
class LayerMemoryCase:
    tp: int = 1
    sequence_parallel: bool = False
    seq: int = 128
    batch: int = 2
    hidden: int = 256
    heads: int = 8
    module: str = "layer"  # "layer" (whole transformer layer) or "mlp" (its MLP only: torch LayerNorm refuses SP)


def layer_memory_probe(case: LayerMemoryCase, rank: int, init_method: str) -> dict[str, Any]:
    """Bytes one transformer layer saves for backward per micro-batch, and what the store holds between B and W."""
    with rank_process_group(rank, case.tp, init_method, tp=case.tp):
        import torch
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer.transformer_layer import TransformerLayer

        from ..runtime.wgrad import get_weight_grad_store
        from ..runtime.wgrad_hooks import install_wgrad_hooks
        from ..verification.tiny_gpt import TinyGPTSpec, make_config

        model_parallel_cuda_manual_seed(1)
        config = make_config(
            TinyGPTSpec(num_layers=1, hidden_size=case.hidden, num_attention_heads=case.heads),
            tp=case.tp,
            sequence_parallel=case.sequence_parallel,
        )
        spec = get_gpt_layer_local_spec()
        if case.module == "mlp":
            from megatron.core.transformer.mlp import MLP

            layer = MLP(config, spec.submodules.mlp.keywords["submodules"])
        else:
            layer = TransformerLayer(config, spec.submodules)
        params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        seq = case.seq // case.tp if case.sequence_parallel else case.seq
        x = torch.randn(seq, case.batch, case.hidden, requires_grad=True)
        saved: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                saved[storage.data_ptr()] = storage.nbytes()
            return t

        install_wgrad_hooks()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out, _ = layer(x) if case.module == "mlp" else layer(x, attention_mask=None)
        store = get_weight_grad_store()
        held = [0]
        store.on_held_bytes = lambda n: held.__setitem__(0, held[0] + n)
        gathered = [0]
        from megatron.core.tensor_parallel import layers as mlayers
        from megatron.core.tensor_parallel import mappings as mmappings

        original = mlayers.dist_all_gather_func

        def counting(output: Any, input: Any, *a: Any, **k: Any) -> Any:
            gathered[0] += output.numel() * output.element_size()
            return original(output, input, *a, **k)

        mlayers.dist_all_gather_func = counting
        mmappings.dist_all_gather_func = counting
        with store.deferring(0, 0, enabled=True, where="probe"):
            out.backward(torch.ones_like(out))
        gathered_in_b = gathered[0]
        held_between = held[0]
        store.run(0, 0, "probe")
        split_total = gathered[0]
        out2, _ = layer(x) if case.module == "mlp" else layer(x, attention_mask=None)
        before = gathered[0]
        out2.backward(torch.ones_like(out2))  # the unsplit backward, for comparison
        unsplit_backward = gathered[0] - before
        mlayers.dist_all_gather_func = original
        mmappings.dist_all_gather_func = original
        return {
            "rank": rank,
            "saved_activation_bytes": sum(saved.values()),
            "store_held_bytes": held_between,
            "all_gather_bytes_in_b": gathered_in_b,
            "all_gather_bytes_in_w": split_total - gathered_in_b,
            "all_gather_bytes_unsplit_backward": unsplit_backward,
            "input_bytes": x.numel() * x.element_size(),
        }
