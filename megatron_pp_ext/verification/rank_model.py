"""One rank's model and optimizer for a verification run: its chunks of the tiny GPT, wrapped as the spec asks.

:func:`build_rank_model` builds the chunks the schedule's placement gives this pipeline rank (float64 for
the exact reference, on GPU 0 for ``device="cuda"``) and wraps them in megatron DDP (overlapped gradient
reduction with data parallelism, megatron's distributed optimizer), in our FSDP (``runtime/fsdp.py``) or
in nothing (plain autograd); the optimizer is torch's Adam or megatron-core's, wrapped by post-validation
on request. The training loop itself is :mod:`.rank_run`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .run_spec import OURS, RunSpec


@dataclass
class RankModel:
    """What :func:`build_rank_model` built on this rank."""

    chunks: list[Any]  # this rank's model chunks, wrapped (DDP, FSDP or plain)
    layouts: list[Any]  # the chunks' layer layouts (tiny_gpt.build_chunks)
    config: Any  # the TransformerConfig the chunks share
    placement: Any
    params: list[Any]  # every parameter of the chunks
    optimizer: Any
    validator: Any = None  # post-validation: the optimizer wrapper that validates and rolls back
    fsdp_memory: Any = None  # FSDP: the bytes held per chunk
    replica_group: Any = None  # bidirectional schedules: the group of a replica's two copies


def build_rank_model(spec: RunSpec, schedule: Any) -> RankModel:
    """This rank's chunks for ``schedule``'s placement (megatron's 1F1B placement without a schedule),
    wrapped and with their optimizer, as ``spec`` asks; the process groups are set up already."""
    from megatron.core import parallel_state as ps

    from ..schedules.placement import loop_placement
    from . import tiny_gpt

    pp_rank = ps.get_pipeline_model_parallel_rank()
    placement = schedule.placement if schedule is not None else loop_placement(spec.pp)
    if spec.split_backward:
        from ..runtime.wgrad_hooks import install_wgrad_hooks

        install_wgrad_hooks()
    config = tiny_gpt.make_config(spec.model, tp=spec.tp, sequence_parallel=spec.sequence_parallel, ep=spec.ep)
    chunks, layouts = tiny_gpt.build_chunks(config, spec.model, placement, pp_rank)
    if spec.float64:
        chunks = tiny_gpt.widen_to_float64(chunks, config)
    if spec.device == "cuda":
        chunks = [c.cuda() for c in chunks]
    fsdp_memory = None
    if spec.fsdp:
        chunks, fsdp_memory = _fsdp(spec, chunks, config)
    elif spec.use_ddp:
        chunks = _ddp(spec, chunks, config)
    params = [p for c in chunks for p in c.parameters()]
    validator: Any = None
    if spec.fsdp:
        optimizer = _torch_optimizer(spec, [p for c in chunks for p in c.optimizer_params()])
    elif spec.distributed_optimizer or spec.megatron_optimizer:
        optimizer = _megatron_optimizer(spec, chunks)
        if spec.post_validation:
            from ..runtime.post_validation import wrap

            optimizer = validator = wrap(optimizer, params, spec.distributed_optimizer)
    else:
        optimizer = _torch_optimizer(spec, params)
    replica_group = None
    if placement.num_replicas == 2 and spec.mode == OURS:
        from ..runtime.replica_sync import new_replica_group

        replica_group = new_replica_group(ps.get_pipeline_model_parallel_group())
    return RankModel(chunks, layouts, config, placement, params, optimizer, validator, fsdp_memory, replica_group)


def _fsdp(spec: RunSpec, chunks: list[Any], config: Any) -> tuple[list[Any], Any]:
    """Each chunk sharded over the data-parallel group; the executor gathers and frees them."""
    from megatron.core import parallel_state as ps

    from ..runtime.fsdp import FsdpMemory, ShardedChunk, finalize_sharded_grads

    memory = FsdpMemory()
    sharded = [
        ShardedChunk(c, ps.get_data_parallel_group(), name=f"chunk{i}", memory=memory, timeout_s=spec.timeout_s)
        for i, c in enumerate(chunks)
    ]
    config.grad_sync_func = [lambda params, c=c: c.start_grad_reduce() for c in sharded]
    config.finalize_model_grads_func = finalize_sharded_grads
    return sharded, memory


def _ddp(spec: RunSpec, chunks: list[Any], config: Any) -> list[Any]:
    """megatron DDP around each chunk, with the config's sync functions set as megatron's training loop does."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    overlap = spec.dp > 1 or spec.distributed_optimizer
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=overlap,
        use_distributed_optimizer=spec.distributed_optimizer,
        overlap_param_gather=spec.distributed_optimizer,
    )
    chunks = [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=c, disable_bucketing=(i > 0))
        for i, c in enumerate(chunks)
    ]
    config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
    # as megatron's training loop does with overlap_grad_reduce / overlap_param_gather and align_*: a list
    # with virtual stages, a function without (what megatron's own schedules expect)
    if overlap:
        grad_sync = [c.start_grad_sync for c in chunks]
        config.grad_sync_func = grad_sync if len(chunks) > 1 else grad_sync[0]
    if spec.distributed_optimizer:
        param_sync = [c.start_param_sync for c in chunks]
        config.param_sync_func = param_sync if len(chunks) > 1 else param_sync[0]
    config.finalize_model_grads_func = finalize_model_grads
    return chunks


def _torch_optimizer(spec: RunSpec, params: list[Any]) -> Any:
    import torch

    return torch.optim.Adam(params, lr=spec.lr, eps=spec.adam_eps)


def _megatron_optimizer(spec: RunSpec, chunks: list[Any]) -> Any:
    """megatron-core's (distributed) Adam, as the training loop builds it; no weight decay. With a loss
    scale, megatron's mixed-precision wrapper (fp32 parameters kept as they are; a constant scaler and
    its found-inf check and skip)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from ..integration.cpu import enable_megatron_optimizer_on_cpu

    enable_megatron_optimizer_on_cpu()

    config = OptimizerConfig(
        optimizer="adam",
        lr=spec.lr,
        adam_eps=spec.adam_eps,
        weight_decay=0.0,
        clip_grad=spec.clip_grad,
        use_distributed_optimizer=spec.distributed_optimizer,
        bf16=spec.loss_scale is not None,  # selects the mixed-precision wrapper; parameters stay fp32
        loss_scale=spec.loss_scale,
    )
    return get_megatron_optimizer(config, chunks)


def inject_inf(chunk: Any, use_ddp: bool) -> None:
    """Testing aid (``RunHooks.inject_inf``): an overflow in this rank's gradients, as an fp16 backward
    produces one."""
    from . import tiny_gpt

    p = next(tiny_gpt._unwrap(chunk).parameters())
    g = p.main_grad if use_ddp else p.grad
    g.view(-1)[0] = float("inf")


def owned_grad_ranges(ddp_chunk: Any, dp_rank: int, dp: int) -> dict[Any, list[tuple[int, int]]]:
    """Per parameter, the element ranges (of its flattened grad) inside this data-parallel rank's
    shard of the grad buffer: after megatron's reduce-scatter only those hold the reduced gradient."""
    owned: dict[Any, list[tuple[int, int]]] = {}
    for buffer in ddp_chunk.buffers:
        for param, (start, end, bucket_id) in buffer.param_index_map.items():
            bucket = buffer.buckets[bucket_id]
            shard = bucket.grad_data.numel() // dp
            lo = max(start, bucket.offset + dp_rank * shard)
            hi = min(end, bucket.offset + (dp_rank + 1) * shard)
            if lo < hi:
                owned.setdefault(param, []).append((lo - start, hi - start))
    return owned
