"""Rank function: the TE adapter (on the stand-in) under real megatron-core DDP vs the unsplit backward.

Each rank builds a chunk of stand-in TE layers (column- and row-parallel linears, a torch LayerNorm, a
two-entry MLP, a three-expert grouped linear), wraps it in megatron's ``DistributedDataParallel`` and runs
several micro-batches twice:
unsplit (TE layers built without deferral, DDP as megatron builds it), then split (``patch_for_split``
active: layers defer, DDP hooks them on the module; B0 B1 W0 B2 W1 W2 ... with gradient sync enabled
during the last B and the last W, as the executor does). It returns every ``main_grad`` and input-gradient
mismatch, parameters whose ``main_grad`` stayed zero, and how often megatron's grad-ready hook fired.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

EXPERT_SPLITS = [1, 2, 1]  # rows of a micro-batch per expert of the grouped linear


@dataclass(frozen=True)
class TEDDPCase:
    tp: int = 2
    dp: int = 2
    overlap_grad_reduce: bool = True
    distributed_optimizer: bool = False
    fused: bool = False  # TE's fuse_wgrad_accumulation (megatron's gradient_accumulation_fusion)
    microbatches: int = 3
    hidden: int = 8
    ffn: int = 12
    seed: int = 11


def _chunk(case: TEDDPCase, tp_group: Any) -> Any:
    import torch

    from . import te_standin as te

    class Chunk(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            gen = torch.Generator().manual_seed(case.seed)
            w1 = torch.randn(case.ffn, case.hidden, generator=gen) * 0.3
            w2 = torch.randn(case.hidden, case.ffn, generator=gen) * 0.3
            kw = {"tp_group": tp_group, "tp_size": case.tp, "fuse_wgrad_accumulation": case.fused}
            self.fc1 = te.Linear(case.hidden, case.ffn, parallel_mode="column", init=w1, **kw)
            self.fc2 = te.Linear(case.ffn, case.hidden, parallel_mode="row", init=w2, **kw)
            self.norm = torch.nn.LayerNorm(case.hidden)
            self.mlp = te.LayerNormMLP(case.hidden, case.ffn, fuse_wgrad_accumulation=case.fused)
            self.experts = te.GroupedLinear(  # unsharded (as megatron builds experts), the same on every rank
                len(EXPERT_SPLITS),
                case.hidden,
                case.hidden,
                bias=False,
                fuse_wgrad_accumulation=case.fused,
                init_method=lambda w: w.copy_(torch.randn(w.shape, generator=gen) * 0.3),
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.mlp(self.norm(self.fc2(torch.nn.functional.gelu(self.fc1(x)))))
            return self.experts(h, EXPERT_SPLITS)

    return Chunk()


def _run(case: TEDDPCase, split: bool) -> dict[str, Any]:
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_pp_ext.integration._patching import Patcher
    from megatron_pp_ext.runtime.te_wgrad import enable_te_wgrad, patch_for_split, pending_te_entries
    from megatron_pp_ext.runtime.wgrad import WeightGradStore

    from . import te_standin as te

    patcher = Patcher()
    if split:
        patch_for_split(patcher, te.STANDIN_LAYER_CLASSES, DistributedDataParallel)
    try:
        config = TransformerConfig(
            num_layers=1,
            hidden_size=case.hidden,
            num_attention_heads=case.tp,
            tensor_model_parallel_size=case.tp,
            use_cpu_initialization=True,
            params_dtype=torch.float32,
        )
        ddp_config = DistributedDataParallelConfig(
            overlap_grad_reduce=case.overlap_grad_reduce,
            use_distributed_optimizer=case.distributed_optimizer,
            grad_reduce_in_fp32=True,
        )
        chunk = _chunk(case, ps.get_tensor_model_parallel_group())
        ddp = DistributedDataParallel(config, ddp_config, chunk)
        names = {p: n for n, p in ddp.module.named_parameters()}
        counts: Counter[str] = Counter()
        for group in ddp.bucket_groups:
            original = group.register_grad_ready

            def counting(param: Any, force_all_reduce: Any = False, _orig: Any = original) -> Any:
                counts[names[param]] += 1
                return _orig(param, force_all_reduce)

            group.register_grad_ready = counting
        ddp.zero_grad_buffer()
        gen = torch.Generator().manual_seed(case.seed + 1000 * ps.get_data_parallel_rank())
        xs = [torch.randn(4, case.hidden, generator=gen).requires_grad_() for _ in range(case.microbatches)]
        outs = [ddp(x) for x in xs]
        last = case.microbatches - 1
        if not split:
            for mb, out in enumerate(outs):
                if mb < last:
                    with ddp.no_sync():
                        out.square().sum().backward()
                else:
                    out.square().sum().backward()
        else:
            store = WeightGradStore()
            enable_te_wgrad(store)
            program = []
            for mb in range(case.microbatches):
                program.append(("B", mb))
                if mb:
                    program.append(("W", mb - 1))
            program.append(("W", last))
            for kind, mb in program:
                sync = mb == last
                with ddp.no_sync() if not sync else _Null():
                    if kind == "B":
                        with store.deferring(0, mb, enabled=True, where="te_ddp_check", model_chunk=ddp.module):
                            outs[mb].square().sum().backward()
                    else:
                        store.run(0, mb, "te_ddp_check")
            store.check_empty("te_ddp_check")
            assert pending_te_entries(ddp.module) == []
        ddp.finish_grad_sync()
        grads = {n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()}
        grads.update({f"x{k}": x.grad.clone() for k, x in enumerate(xs)})
        return {"grads": grads, "counts": dict(counts)}
    finally:
        patcher.restore()


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def te_ddp_check(case: TEDDPCase, rank: int, init_method: str) -> dict[str, Any]:
    from megatron_pp_ext.verification.rank_setup import rank_process_group

    world = case.tp * case.dp
    with rank_process_group(rank, world, init_method, timeout_s=60.0, tp=case.tp):
        import torch

        ref = _run(case, split=False)
        split = _run(case, split=True)
        mismatched = [
            n for n in ref["grads"] if not torch.allclose(ref["grads"][n], split["grads"][n], rtol=1e-6, atol=1e-6)
        ]
        missing = [n for n, g in split["grads"].items() if not n.startswith("x") and not g.abs().sum() > 0]
        return {
            "rank": rank,
            "checked": sorted(ref["grads"]),
            "mismatched": mismatched,
            "missing": missing,
            "ready_counts": split["counts"],
            "ref_ready_counts": ref["counts"],
        }
