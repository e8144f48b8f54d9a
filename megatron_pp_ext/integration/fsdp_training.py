"""``--pipeline-fsdp``: megatron's training loop with per-chunk FSDP (:class:`..runtime.fsdp.ShardedChunk`).

megatron-core 0.19.2 refuses its own FSDP variants with pipeline parallelism. With ``--pipeline-fsdp``
:func:`patch_megatron` (applied by :func:`megatron_pp_ext.install`) makes ``pretrain()`` shard each
model chunk over its data-parallel group instead of wrapping it in megatron DDP, with three patches:

* ``megatron.training.models.dist_utils._ddp_wrap`` (the config-container path ``pretrain()`` takes) and
  ``megatron.training.training.wrap_model_chunks_with_ddp`` (``get_model``'s path, Megatron-LM's own
  ``pretrain_gpt.py``): build :class:`MegatronShardedChunk` s and set the model config's
  ``grad_sync_func`` (per chunk: ``start_grad_reduce``, which the executor calls at the chunk's derived
  reduce point) and ``finalize_model_grads_func`` (:func:`~megatron_pp_ext.runtime.fsdp.finalize_sharded_grads`;
  megatron's ``train()`` keeps a hook already set). Megatron's ``train()`` sets ``no_sync_func`` /
  ``grad_sync_func`` only for its own DDP classes, so nothing overrides them.
* ``megatron.training.training.get_megatron_optimizer`` (imported there by name): for sharded chunks,
  :class:`ShardedAdamW`, which speaks the part of ``MegatronOptimizer`` the training loop uses
  (``step() -> (success, grad_norm, num_zeros)``, ``zero_grad``, ``param_groups`` for the lr scheduler,
  ``get_loss_scale``, ``scale_loss``) and updates the fp32 shards with torch's AdamW arithmetic, megatron's
  weight-decay rule (no decay for biases and 1-D parameters) and megatron's gradient clipping, the norm
  summed over the data-parallel and pipeline groups (:meth:`ShardedChunk.local_grad_sq_norm`).

``train_step`` calls ``zero_grad_buffer()`` on every chunk before each iteration: for a sharded chunk that
is :meth:`ShardedChunk.start_iteration`. :func:`.features.chunk_fsdp.check_arguments` refuses what this does not cover,
from the flags, one line each. Checkpoints of shards are not implemented (``--save`` / ``--load`` refused).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..runtime.fsdp import FsdpMemory, ShardedChunk, finalize_sharded_grads
from ._patching import Patcher
from .config import FSDP_FLAG as FLAG


# ---- model chunks -------------------------------------------------------------------------------------
class MegatronShardedChunk(ShardedChunk):
    """A :class:`ShardedChunk` with the model-chunk methods megatron's training loop calls on DDP chunks."""

    force_all_reduce: bool = False  # train_step sets it on every chunk (megatron DDP's flag); unused here

    def zero_grad_buffer(self) -> None:
        """``train_step``'s per-iteration reset: the gradient buffer is allocated at the first gradient."""
        self.start_iteration()

    def broadcast_params(self) -> None:
        """No-op: the weights were broadcast over the data-parallel group before sharding."""


def _dp_group(pg_collection: Any) -> Any:
    group = getattr(pg_collection, "dp", None) if pg_collection is not None else None
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_data_parallel_group()
    return group


def shard_model_chunks(model: Sequence[torch.nn.Module], pg_collection: Any = None) -> list[MegatronShardedChunk]:
    """Shard every chunk over the data-parallel group and point megatron's hooks at the shards."""
    from megatron.core.utils import get_model_config
    from megatron.training.utils import print_rank_0

    group = _dp_group(pg_collection)
    source = dist.get_global_rank(group, 0)
    with torch.no_grad():  # identical weights on every DP rank before sharding (megatron DDP's broadcast_params)
        for chunk in model:
            for param in chunk.parameters():
                dist.broadcast(param.data, src=source, group=group)
    memory = FsdpMemory()
    chunks = [MegatronShardedChunk(c, group, name=f"chunk {i}", memory=memory) for i, c in enumerate(model)]
    config = get_model_config(chunks[0])
    config.grad_sync_func = [lambda params, c=c: c.start_grad_reduce() for c in chunks]
    config.finalize_model_grads_func = finalize_sharded_grads
    print_rank_0(
        f"> megatron_pp_ext: {FLAG}: {len(chunks)} chunk(s) per rank sharded over {chunks[0].world} data-parallel "
        f"rank(s) ({sum(c.shard_numel for c in chunks)} of {sum(c.numel for c in chunks)} parameters per rank)"
    )
    return chunks


def _ddp_wrap(model: list[Any], data_parallel_random_init: bool, *args: Any, **kwargs: Any) -> list[Any]:
    """Replaces ``megatron.training.models.dist_utils._ddp_wrap`` under ``--pipeline-fsdp``."""
    return shard_model_chunks(model, kwargs.get("pg_collection"))


def _wrap_model_chunks_with_ddp(model_chunks: list[Any], config: Any, ddp_config: Any, **kwargs: Any) -> list[Any]:
    """Replaces ``megatron.training.training.wrap_model_chunks_with_ddp`` under ``--pipeline-fsdp``."""
    return shard_model_chunks(model_chunks, kwargs.get("pg_collection"))


# ---- optimizer ----------------------------------------------------------------------------------------
def _no_weight_decay(name: str, param: torch.Tensor) -> bool:
    """megatron's classic rule (``get_standard_config_overrides``): biases and 1-D parameters."""
    return name.endswith(".bias") or len(param.shape) == 1


class ShardedAdamW:
    """AdamW over the fp32 shards of :class:`ShardedChunk` s, as megatron's ``FP32Optimizer`` runs torch's AdamW.

    ``param_groups``: megatron's two groups (weight decay ``wd_mult`` 1 and 0); the lr scheduler writes their
    ``lr`` and ``weight_decay``, each shard element takes its group's values through a mask. The update is
    torch's single-tensor AdamW (``decoupled_weight_decay``; else Adam with L2 decay added to the gradient).
    """

    is_stub_optimizer = False

    def __init__(self, config: Any, chunks: Sequence[ShardedChunk]) -> None:
        from megatron.core import parallel_state

        self.config = config
        self.chunks = list(chunks)
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        base = {"lr": config.lr, "weight_decay": config.weight_decay, "lr_mult": 1.0, "is_decoupled_lr": False}
        base.update(max_lr=config.lr, min_lr=config.min_lr, default_config=True, is_expert_parallel=False)
        self.param_groups: list[dict[str, Any]] = [
            {**base, "params": [c.main_shard for c in self.chunks], "wd_mult": 1.0},
            {**base, "params": [], "wd_mult": 0.0, "weight_decay": 0.0},  # the lr scheduler keeps wd * wd_mult
        ]
        self._no_decay = [c.shard_mask(_no_weight_decay) for c in self.chunks]
        self._state = [(torch.zeros_like(c.main_shard), torch.zeros_like(c.main_shard)) for c in self.chunks]
        self._step = 0
        self._scale = torch.ones(1)

    # ---- the MegatronOptimizer surface the training loop uses ------------------------------------------
    def get_loss_scale(self) -> torch.Tensor:
        return self._scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for chunk in self.chunks:
            chunk.main_shard.grad = None

    def reload_model_params(self, state_dict: Any = None) -> None:
        """Nothing to reload: the shards are the parameters."""

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError(f"{FLAG}: checkpoints of FSDP shards are not supported yet")

    def load_state_dict(self, state_dict: Any) -> None:
        raise NotImplementedError(f"{FLAG}: checkpoints of FSDP shards are not supported yet")

    # ---- step ------------------------------------------------------------------------------------------
    def _all_ranks_sum(self, value: torch.Tensor) -> torch.Tensor:
        """Sum over the data-parallel group (disjoint shards) and the pipeline group (disjoint stages)."""
        groups = [self.chunks[0].group] if self.chunks else []
        for group in [*groups, self.pp_group]:
            if dist.get_world_size(group) > 1:
                dist.all_reduce(value, group=group)
        return value

    def _grads(self) -> list[torch.Tensor]:
        grads = []
        for chunk in self.chunks:
            if chunk.main_shard.grad is None:
                raise RuntimeError(f"{FLAG}: {chunk.chunk_name} has no reduced gradient at the optimizer step")
            grads.append(chunk.main_shard.grad)
        return grads

    @torch.no_grad()
    def clip_grad_norm(self, clip_grad: float) -> float:
        """megatron's ``clip_grad_by_total_norm_fp32`` on the shards: the global L2 norm, and the scaling."""
        squares = sum((c.local_grad_sq_norm() for c in self.chunks), torch.zeros([], dtype=torch.float64))
        norm = float(self._all_ranks_sum(squares.reshape(1))[0]) ** 0.5
        coeff = clip_grad / (norm + 1.0e-6)
        if coeff < 1.0:
            for grad in self._grads():
                grad.mul_(coeff)
        return norm

    def count_zeros(self) -> float:
        zeros = torch.zeros(1, dtype=torch.float64)
        for chunk, grad in zip(self.chunks, self._grads(), strict=True):
            real = max(0, min(chunk.shard_numel, chunk.numel - chunk.rank * chunk.shard_numel))  # no padding
            zeros += (grad[:real] == 0).sum()
        return float(self._all_ranks_sum(zeros)[0])

    @torch.no_grad()
    def step(self) -> tuple[bool, float | None, float | None]:
        grads = self._grads()
        grad_norm = self.clip_grad_norm(self.config.clip_grad) if self.config.clip_grad > 0.0 else None
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        decay, no_decay = self.param_groups
        if decay["lr"] != no_decay["lr"]:
            raise RuntimeError(f"{FLAG}: one learning rate for all parameters only")
        lr = float(decay["lr"])
        beta1, beta2, eps = self.config.adam_beta1, self.config.adam_beta2, self.config.adam_eps
        self._step += 1
        bias_correction1 = 1 - beta1**self._step
        bias_correction2_sqrt = math.sqrt(1 - beta2**self._step)
        decoupled = getattr(self.config, "decoupled_weight_decay", True)
        for chunk, grad, mask, state in zip(self.chunks, grads, self._no_decay, self._state, strict=True):
            param, (exp_avg, exp_avg_sq) = chunk.main_shard, state
            wd = torch.where(mask, float(no_decay["weight_decay"]), float(decay["weight_decay"]))
            if decoupled:
                param.mul_(1 - lr * wd)
            else:
                grad = grad.add(param * wd)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
            param.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
        return True, grad_norm, num_zeros


def get_megatron_optimizer_for(original: Callable[..., Any]) -> Callable[..., Any]:
    """``get_megatron_optimizer``: :class:`ShardedAdamW` for sharded chunks, megatron's otherwise."""

    def get_megatron_optimizer(config: Any, model_chunks: list[Any], *args: Any, **kwargs: Any) -> Any:
        if model_chunks and all(isinstance(c, ShardedChunk) for c in model_chunks):
            return ShardedAdamW(config, model_chunks)
        return original(config, model_chunks, *args, **kwargs)

    return get_megatron_optimizer


def patch_megatron(patcher: Patcher) -> None:
    """Apply the ``--pipeline-fsdp`` patches (undone with the patcher)."""
    patcher.replace("megatron.training.models.dist_utils", "_ddp_wrap", _ddp_wrap)
    patcher.replace("megatron.training.training", "wrap_model_chunks_with_ddp", _wrap_model_chunks_with_ddp)
    original = patcher.original("megatron.training.training", "get_megatron_optimizer")
    if original is None:
        import megatron.training.training as training

        original = training.get_megatron_optimizer
    patcher.replace("megatron.training.training", "get_megatron_optimizer", get_megatron_optimizer_for(original))
