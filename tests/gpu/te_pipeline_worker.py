"""One rank of the GPU check: a split schedule with the TE layer spec vs the same schedule unsplit.

Launched by tests/gpu/test_te_pipeline_gpu.py as ``torchrun --nproc-per-node 2 te_pipeline_worker.py
--schedule zb-h1 --out DIR``. Builds a tiny GPTModel per chunk with megatron's Transformer Engine layer spec,
wrapped in megatron DDP (``--overlap-grad-reduce``: with its overlapped reduction), and runs two
training iterations (Adam step in between) twice on the same data:

* split: the plugin's patches active (TE layers built with ``delay_wgrad_compute=True``, DDP hooks them,
  the TE provider runs ``backward_dw`` in W ops), the schedule as generated (B and W ops); the runtime
  guard watches every iteration;
* reference: no patches, the same op order with each B turned into a full backward and its W dropped.

Writes ``DIR/rank{R}.json``: per iteration the losses, the largest relative gradient difference per
parameter, how many TE layers deferred, and the parameters whose gradient stayed zero. ``--num-experts N``:
every layer's MLP is megatron's MoE layer with its grouped-GEMM experts (``TEGroupedMLP``, TE's
``GroupedLinear``), as ``--moe-grouped-gemm`` builds them. ``--cpu-smoke``
checks the harness itself on CPU/gloo with the local spec (megatron-linear split only, no TE).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


def unsplit(schedule: Any) -> Any:
    from megatron_pp_ext.schedules import BW, OpKind
    from megatron_pp_ext.schedules.schedule import Schedule

    ops = tuple(
        tuple(BW(op.stage, op.microbatch) if op.kind == OpKind.B else op for op in rank_ops if op.kind != OpKind.W)
        for rank_ops in schedule.ops
    )
    return Schedule(schedule.placement, schedule.num_microbatches, ops, name=f"{schedule.name}-unsplit")


def _cuda_batches(batches: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    return [{k: v.cuda() for k, v in b.items()} for b in batches]


def run(schedule: Any, split: bool, spec: Any, iterations: int, overlap: bool) -> dict[str, Any]:
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from megatron_pp_ext.integration._patching import Patcher
    from megatron_pp_ext.runtime.executor import make_forward_backward_func
    from megatron_pp_ext.runtime.te_wgrad import deferring_modules, enable_te_wgrad, patch_for_split
    from megatron_pp_ext.runtime.wgrad import get_weight_grad_store
    from megatron_pp_ext.runtime.wgrad_hooks import install_wgrad_hooks, uninstall_wgrad_hooks
    from megatron_pp_ext.verification import tiny_gpt

    patcher = Patcher()
    store = get_weight_grad_store()
    if split:
        install_wgrad_hooks()
        if spec.transformer_impl == "transformer_engine":
            patch_for_split(patcher)
            enable_te_wgrad(store)
    try:
        rank = ps.get_pipeline_model_parallel_rank()
        config = tiny_gpt.make_config(spec)
        chunks, layouts = tiny_gpt.build_chunks(config, spec, schedule.placement, rank)
        chunks = [c.cuda() for c in chunks]
        ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=overlap, use_distributed_optimizer=False)
        chunks = [
            DistributedDataParallel(config=config, ddp_config=ddp_config, module=c, disable_bucketing=(i > 0))
            for i, c in enumerate(chunks)
        ]
        config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
        config.finalize_model_grads_func = finalize_model_grads
        deferring = sum(len(deferring_modules(c)) for c in chunks)
        params = [p for c in chunks for p in c.parameters()]
        optimizer = torch.optim.Adam(params, lr=1e-4)
        step = make_forward_backward_func(lambda m: schedule, check_grads=True)
        history = []
        for iteration in range(iterations):
            for c in chunks:
                c.zero_grad_buffer()
            batches = _cuda_batches(tiny_gpt.make_batches(spec, iteration, schedule.num_microbatches))
            iterators = [iter(batches) for _ in chunks]
            out = step(
                forward_step_func=tiny_gpt.forward_step,
                data_iterator=iterators if len(chunks) > 1 else iterators[0],
                model=chunks,
                num_microbatches=schedule.num_microbatches,
                seq_length=spec.seq_length,
                micro_batch_size=spec.micro_batch_size,
                decoder_seq_length=spec.seq_length,
                forward_only=False,
            )
            grads = {}
            for chunk, layout in zip(chunks, layouts, strict=True):
                for name, p in tiny_gpt._unwrap(chunk).named_parameters():
                    key = f"{tiny_gpt.global_name(name, layout, spec.tied_embeddings)}#stage{layout.stage}"
                    grads[key] = p.main_grad.detach().float().cpu().clone()
                    p.grad = p.main_grad.detach().clone()
            history.append({"losses": [float(d["lm loss"]) for d in out], "grads": grads})
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return {"history": history, "deferring_te_layers": deferring}
    finally:
        patcher.restore()
        if split:
            uninstall_wgrad_hooks()
            store.providers.clear()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--schedule", required=True)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--out", required=True)
    parser.add_argument("--overlap-grad-reduce", action="store_true", help="megatron DDP's overlap_grad_reduce")
    parser.add_argument(
        "--num-experts",
        type=int,
        default=0,
        help="MoE layers with this many experts: TEGroupedMLP over TE's GroupedLinear (SequentialMLP with --cpu-smoke)",
    )
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="Check this harness on CPU/gloo with the local layer spec (megatron-linear split; no TE).",
    )
    args = parser.parse_args()

    if args.cpu_smoke:
        from megatron_pp_ext.integration.cpu import enable_cpu_mode

        enable_cpu_mode()
        dist.init_process_group("gloo")
    else:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        dist.init_process_group("nccl")
    from megatron.core import parallel_state as ps

    from megatron_pp_ext.runtime.te_wgrad import check_te_support
    from megatron_pp_ext.schedules import registry
    from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec

    if not args.cpu_smoke:
        check_te_support(args.schedule)
    ps.initialize_model_parallel(pipeline_model_parallel_size=dist.get_world_size())
    try:
        p = dist.get_world_size()
        schedule = registry.generate(args.schedule, p, args.microbatches)
        assert schedule.splits_backward, f"{args.schedule} does not split the backward"
        num_layers = 2 * schedule.placement.num_stages
        impl = "local" if args.cpu_smoke else "transformer_engine"
        moe = (
            {"num_experts": args.num_experts, "moe_grouped_gemm": impl == "transformer_engine"}
            if args.num_experts
            else {}
        )
        spec = TinyGPTSpec(num_layers=num_layers, transformer_impl=impl, **moe)
        split = run(schedule, True, spec, args.iterations, args.overlap_grad_reduce)
        ref = run(unsplit(schedule), False, spec, args.iterations, args.overlap_grad_reduce)
        report: dict[str, Any] = {"rank": dist.get_rank(), "deferring_te_layers": split["deferring_te_layers"]}
        iterations = []
        for a, b in zip(split["history"], ref["history"], strict=True):
            diffs = {}
            for name, g in b["grads"].items():
                s = a["grads"][name]
                diffs[name] = float((s - g).abs().max() / g.abs().max().clamp_min(1e-12))
            zero = sorted(n for n, g in a["grads"].items() if not g.abs().sum() > 0)
            iterations.append({"losses": a["losses"], "ref_losses": b["losses"], "rel_diff": diffs, "zero": zero})
        report["iterations"] = iterations
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"rank{dist.get_rank()}.json").write_text(json.dumps(report, indent=1))
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
