"""What a backward split into input (B) and weight (W) gradients costs against the fused backward (BW), per
micro-batch on one stage, for torch.distributed.pipelining's split and ours, on a megatron-core chunk and on a
chunk of plain torch layers of the same shape.

torch splits any module generically (``stage_backward_input``: ``autograd.grad`` to the stage input, keeping the
graph; ``stage_backward_weight``: ``autograd.grad`` from the saved intermediate nodes to the weights). megatron's
linear layers are custom autograd functions whose one backward computes the input and the weight gradient
together, so torch's B already pays the weight gradient and its W runs those backwards again; plain ``nn.Linear``
layers (``addmm``) split cleanly. Ours splits megatron's functions themselves (weight-gradient hooks: B queues a
closure per layer, W runs it). Measured on one rank (a process group of one), a middle stage (no embedding, no
output layer), medians over repetitions, one thread.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

from ..verification.rank_setup import rank_process_group
from ..verification.tiny_gpt import TinyGPTSpec

KINDS = ("F", "BW", "torch B", "torch W", "ours B", "ours W")
WHERE = "split-cost measurement"  # named in the weight-gradient store's errors


@dataclass(frozen=True)
class SplitCostSpec:
    model: TinyGPTSpec  # the pipeline's model; one middle stage of ``layers`` layers is measured
    layers: int
    repeats: int = 7
    timeout_s: float = 600.0


def run_on_rank(spec: SplitCostSpec, rank: int, init_method: str) -> dict[str, Any]:
    from ..runtime.wgrad_hooks import install_wgrad_hooks, uninstall_wgrad_hooks

    with rank_process_group(rank, 1, init_method, timeout_s=spec.timeout_s, pp=1):
        install_wgrad_hooks()  # before the model is built
        try:
            return {"megatron": _measure(spec, _megatron_chunk(spec), ours=True), "plain": _plain(spec)}
        finally:
            uninstall_wgrad_hooks()


def _megatron_chunk(spec: SplitCostSpec) -> Any:
    """A megatron-core GPTModel holding ``layers`` decoder layers, no embedding, no output layer."""
    from dataclasses import replace

    from ..schedules.placement import loop_placement
    from ..verification import tiny_gpt

    model = replace(spec.model, num_layers=3 * spec.layers)
    placement = loop_placement(3)
    config = tiny_gpt.make_config(model)
    chunks, _ = tiny_gpt.build_chunks(config, model, placement, 1)
    chunk = chunks[0]

    class Middle:  # hidden states in, hidden states out (megatron's set_input_tensor)
        def __init__(self) -> None:
            self.module = chunk

        def __call__(self, x: Any) -> Any:
            chunk.set_input_tensor(x)
            return chunk(None, None, None)

    return Middle()


def _plain(spec: SplitCostSpec) -> dict[str, float]:
    """The same shape in plain torch layers (pre-norm attention and MLP blocks of nn.Linear / LayerNorm)."""
    import torch

    from .plain_chunks import Block

    torch.manual_seed(spec.model.seed)
    h, heads = spec.model.hidden_size, spec.model.num_attention_heads
    module = torch.nn.Sequential(*(Block(h, heads) for _ in range(spec.layers)))

    class Plain:
        def __init__(self) -> None:
            self.module = module

        def __call__(self, x: Any) -> Any:
            return module(x)

    return _measure(spec, Plain(), ours=False)


def _measure(spec: SplitCostSpec, chunk: Any, *, ours: bool) -> dict[str, float]:
    """Median seconds of each kind of :data:`KINDS` (ours only on megatron's chunk)."""
    import torch
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    from ..runtime.wgrad import get_weight_grad_store

    model = spec.model
    shape = (model.seq_length, model.micro_batch_size, model.hidden_size)
    gen = torch.Generator().manual_seed(model.seed)
    x0, grad = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    params = list(chunk.module.parameters())
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}

    def forward() -> tuple[Any, Any]:
        x = x0.clone().requires_grad_(True)
        started = time.perf_counter()
        out = chunk(x)
        times["F"].append(time.perf_counter() - started)
        return x, out

    def timed(kind: str, fn: Any, *args: Any) -> Any:
        started = time.perf_counter()
        out = fn(*args)
        times[kind].append(time.perf_counter() - started)
        return out

    store = get_weight_grad_store()
    for _ in range(spec.repeats + 1):  # the first round warms up
        x, out = forward()
        timed("BW", torch.autograd.backward, out, grad)
        x, out = forward()
        groups = timed("torch B", stage_backward_input, [out], [grad], [x], iter(params))[1]
        timed("torch W", stage_backward_weight, iter(params), groups)
        if ours:
            x, out = forward()
            with store.deferring(0, 0, enabled=True, where=WHERE, model_chunk=chunk.module):
                timed("ours B", torch.autograd.backward, out, grad)
            timed("ours W", store.run, 0, 0, WHERE)
        for p in params:
            p.grad = None
    return {kind: statistics.median(values[1:]) for kind, values in times.items() if len(values) > 1}
