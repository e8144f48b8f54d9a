"""Per-chunk fully sharded parameters (ZeRO-3) driven explicitly by the schedule.

A :class:`ShardedChunk` wraps one megatron-core model chunk on a data-parallel process group of ``N``
ranks. The chunk's parameters become views of one flat, full-size buffer; each rank owns an fp32 shard
(``1/N`` of the padded buffer) that the optimizer updates. Nothing happens implicitly: the executor
calls :meth:`~ShardedChunk.unshard` / :meth:`~ShardedChunk.reshard` where the lowering placed them (once
per sweep, not once per micro-batch) and :meth:`~ShardedChunk.start_grad_reduce` where it placed the
chunk's gradient reductions: after the chunk's last backward of the iteration, or (a policy the schedule
declares, ZeroPP's) after its last gradient op of each scheduling unit.

* ``reshard()`` frees the full buffer's storage (``untyped_storage().resize_(0)``, as FSDP does); the
  parameter tensors and every view autograd saved keep pointing at that storage, so after ``unshard()``
  re-allocates it and all-gathers the shards into it, a backward that saved weights in an earlier
  sweep reads the re-gathered values.
* Gradients accumulate, across micro-batches, into a full-size fp32 flat buffer through
  ``param.main_grad`` views — the attribute megatron DDP gives parameters — with megatron DDP's own
  accumulation rule (``main_grad += grad`` after autograd's ``AccumulateGrad`` unless the fused
  weight-gradient kernel already wrote into ``main_grad``). So megatron's linear layers, with or
  without ``gradient_accumulation_fusion``, and our B/W split (:mod:`.wgrad_hooks`, whose W op
  accumulates through the parameter's own ``AccumulateGrad``) both land in the buffer. The buffer is
  allocated at the chunk's first gradient after a reduction (or of the iteration) and freed when the
  reduce-scatter is done. Several reductions per iteration accumulate into the sharded gradient: the first
  reduce-scatters into it, each later one into a shard-sized scratch that is then added; a gradient arriving
  while a reduction of the chunk is in flight first waits for it (the buffer is in use).
* Scaling matches megatron DDP's default (``average_in_collective=False``): the full gradient is
  multiplied by ``1/N`` and reduce-scattered with ``SUM``, so the shard holds the data-parallel
  *average* (``average=False`` gives the sum, as megatron with ``calculate_per_token_loss``).

Why our own flat buffer rather than torch FSDP2 (``fully_shard`` with explicit ``unshard()`` /
``reshard()``) or Megatron-FSDP: FSDP2 turns parameters into ``DTensor`` shards and owns gradient
handling through its post-backward hooks, which reduce-scatter ``param.grad`` when a module's backward
ends. megatron-core's layers and our deferred W accumulate into ``param.main_grad`` and the weight
gradient of a micro-batch may be computed long after its backward ran (after the chunk was resharded
and gathered again); under FSDP2 that gradient would be reduced early, per micro-batch, or lost, and
the schedule, not a module hook, must decide when the single reduce-scatter of the iteration runs.
Megatron-FSDP (``megatron_fsdp``) likewise drives gathers and reduces from module hooks and its own
bucket machinery tied to megatron DDP's config, reduces after every backward under ZeRO-2/3 and runs on
CUDA only (megatron-core refuses torch FSDP2 with pipeline parallelism, not Megatron-FSDP). A flat
buffer per chunk is small, works identically on gloo and NCCL (two
collectives: ``all_gather_single`` and ``reduce_scatter_single``), keeps megatron's ``main_grad``
contract, and makes every collective an explicit call the lowering can count and the validator can
order. See ``docs/fsdp.md``.
"""

from __future__ import annotations

import datetime
import math
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "FsdpCounters",
    "FsdpError",
    "FsdpMemory",
    "FsdpTimeoutError",
    "ShardedChunk",
    "add_tied_grads_locally",
    "finalize_sharded_grads",
    "tied_embedding_reductions",
]


class FsdpError(RuntimeError):
    """The sharded chunk was driven in an order that cannot be right (e.g. forward while sharded)."""


class FsdpTimeoutError(FsdpError):
    """A collective did not complete in time (a peer skipped or reordered it)."""


@dataclass
class FsdpCounters:
    """Collectives of one chunk: this iteration (reset by ``start_iteration``) and in total."""

    all_gathers: int = 0
    reduce_scatters: int = 0
    extra_all_reduces: int = 0
    total_all_gathers: int = 0
    total_reduce_scatters: int = 0


@dataclass
class FsdpMemory:
    """Bytes one rank holds for its sharded chunks; share one instance between a rank's chunks.

    ``shard`` is the fp32 parameter shards plus the sharded gradients; ``full_params`` and
    ``full_grads`` the gathered parameter buffers and the full gradient buffers alive at a time.
    Optimizer state (Adam's moments, 2x the fp32 shard) is not counted. ``byte_seconds`` integrates each
    kind over wall time (``mean_bytes`` = that over the time since the first allocation): how long full buffers
    live, which reducing gradients per unit shortens even where the peak stays. ``reducing``: the chunks with a
    gradient reduce-scatter in flight; any chunk of the rank retires the completed ones (frees their buffers).
    """

    current: dict[str, int] = field(default_factory=lambda: {"shard": 0, "full_params": 0, "full_grads": 0})
    peak: dict[str, int] = field(default_factory=lambda: {"shard": 0, "full_params": 0, "full_grads": 0})
    peak_total: int = 0
    byte_seconds: dict[str, float] = field(
        default_factory=lambda: {"shard": 0.0, "full_params": 0.0, "full_grads": 0.0}
    )
    reducing: list[Any] = field(default_factory=list, repr=False)
    _since: float | None = None
    _last: float | None = None

    def _integrate(self) -> None:
        now = time.perf_counter()
        if self._last is not None:
            for kind, value in self.current.items():
                self.byte_seconds[kind] += value * (now - self._last)
        else:
            self._since = now
        self._last = now

    def mean_bytes(self) -> dict[str, float]:
        """Time-averaged bytes held per kind since the first allocation."""
        self._integrate()
        span = (self._last or 0.0) - (self._since or 0.0)
        return {kind: (v / span if span > 0 else 0.0) for kind, v in self.byte_seconds.items()}

    def add(self, kind: str, nbytes: int) -> None:
        self._integrate()
        self.current[kind] += nbytes
        assert self.current[kind] >= 0, (kind, self.current[kind])
        self.peak[kind] = max(self.peak[kind], self.current[kind])
        self.peak_total = max(self.peak_total, sum(self.current.values()))

    @property
    def total(self) -> int:
        return sum(self.current.values())

    def reset_peak(self) -> None:
        self.peak = dict(self.current)
        self.peak_total = self.total


_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _free(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.size() != 0:
        storage.resize_(0)


def _alloc(tensor: torch.Tensor, numel: int) -> None:
    storage = tensor.untyped_storage()
    nbytes = numel * tensor.element_size()
    if storage.size() != nbytes:
        assert storage.size() == 0, "resizing a live buffer"
        storage.resize_(nbytes)


def _is_allocated(tensor: torch.Tensor) -> bool:
    return tensor.untyped_storage().size() != 0


class ShardedChunk(torch.nn.Module):
    """One model chunk with fully sharded parameters over a data-parallel group.

    ``module`` holds the same full weights on every rank of ``group`` (as ``tiny_gpt.build_chunks`` and
    megatron's seeded initialisation give). After construction the chunk is *sharded*: call
    :meth:`unshard` before any op that reads weights (F, B, BW; a W op of megatron's linears only needs
    the gradient buffer, not the weights).

    ``extra_grad_reductions`` maps a parameter name (``module.named_parameters()``) to a process group
    over which that parameter's full gradient is all-reduced (summed) before the reduce-scatter — e.g.
    the tied word embedding over megatron's embedding group (:func:`tied_embedding_reductions`), or
    sequence-parallel layer-norm weights over the tensor-parallel group — or to a callable that gets
    the full (unscaled) gradient view and may change it in place. Both ends of a tied embedding on
    one rank (V-shape) use :func:`add_tied_grads_locally` instead.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        group: Any = None,
        *,
        name: str = "chunk",
        memory: FsdpMemory | None = None,
        average: bool = True,
        timeout_s: float = 60.0,
        extra_grad_reductions: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.module = module
        self.group = group if group is not None else dist.group.WORLD
        self.chunk_name = name
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        self.global_rank = dist.get_rank()
        self.memory = memory if memory is not None else FsdpMemory()
        self.average = average
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.counters = FsdpCounters()

        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise FsdpError(f"{name}: no trainable parameters to shard")
        dtypes = {p.dtype for _, p in named}
        devices = {p.device for _, p in named}
        if len(dtypes) != 1 or len(devices) != 1:
            raise FsdpError(f"{name}: parameters must share one dtype and device, got {dtypes} on {devices}")
        self.param_dtype = dtypes.pop()
        device = devices.pop()
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._offsets: list[int] = []
        total = 0
        for p in self._params:
            self._offsets.append(total)
            total += p.numel()
        self.numel = total
        self.shard_numel = math.ceil(total / self.world)
        self.padded_numel = self.shard_numel * self.world
        self.extra_grad_reductions = dict(extra_grad_reductions or {})
        unknown = sorted(set(self.extra_grad_reductions) - set(self._names))
        if unknown:
            raise FsdpError(f"{name}: extra_grad_reductions names unknown parameters {unknown}")

        # Full parameter buffer; parameters become views of it.
        self._flat = torch.zeros(self.padded_numel, dtype=self.param_dtype, device=device)
        with torch.no_grad():
            for p, off in zip(self._params, self._offsets, strict=True):
                self._flat[off : off + p.numel()].copy_(p.detach().reshape(-1))
                p.data = self._flat[off : off + p.numel()].view(p.shape)
        lo = self.rank * self.shard_numel
        # The fp32 shard the optimizer updates (a leaf; its .grad is the reduced gradient shard).
        self.main_shard = self._flat[lo : lo + self.shard_numel].detach().to(torch.float32).clone().requires_grad_()
        self._grad_shard = torch.zeros(self.shard_numel, dtype=torch.float32, device=device)
        self.memory.add("shard", 2 * self.shard_numel * 4)

        # Full gradient buffer (fp32, like megatron's main_grad); main_grad are views of it.
        self._grad_flat = torch.zeros(self.padded_numel, dtype=torch.float32, device=device)
        for p, off in zip(self._params, self._offsets, strict=True):
            p.main_grad = self._grad_flat[off : off + p.numel()].view(p.shape)  # type: ignore[attr-defined]
            p.grad_added_to_main_grad = False  # type: ignore[attr-defined]
        _free(self._grad_flat)

        self._unsharded = True  # the buffer is full right now; account for it and free it
        self.memory.add("full_params", self.full_param_bytes)
        self._gather_work: Any = None
        self._reduce_work: Any = None
        self._reductions = 0  # reduce-scatters completed or started this iteration
        self._scratch: torch.Tensor | None = None  # target of a later reduce-scatter of the iteration
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_grad_hook(n)) for n, p in named]
        self.register_forward_pre_hook(self._check_unsharded_for_forward)
        self.reshard()

    # ---- sizes -------------------------------------------------------------------------------
    @property
    def full_param_bytes(self) -> int:
        return self.padded_numel * self._flat.element_size()

    @property
    def full_grad_bytes(self) -> int:
        return self.padded_numel * 4

    @property
    def is_unsharded(self) -> bool:
        return self._unsharded and self._gather_work is None

    @property
    def grad_buffer_allocated(self) -> bool:
        return _is_allocated(self._grad_flat)

    # ---- forward passthrough (megatron's schedules unwrap ``.module`` for set_input_tensor) --------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        output = self.module(*args, **kwargs)
        if isinstance(output, torch.Tensor) and output.grad_fn is not None:
            # The chunk's backward starts at this node: fail clearly if its weights were freed meanwhile
            # (instead of torch's "data is not allocated yet" from deep inside a layer's backward).
            output.grad_fn.register_prehook(self._check_unsharded_for_backward)
        return output

    def _check_unsharded_for_backward(self, _grad_outputs: Any) -> None:
        if not self.is_unsharded:
            raise FsdpError(
                f"rank {self.global_rank}: backward of {self.chunk_name} while its parameters are sharded "
                "(call unshard, and wait_unshard, before the chunk's B/BW ops)"
            )

    def _check_unsharded_for_forward(self, _module: Any, _args: Any) -> None:
        self.retire_completed_reductions()
        if not self.is_unsharded:
            state = "gathering (call wait_unshard)" if self._gather_work is not None else "sharded (call unshard)"
            raise FsdpError(f"rank {self.global_rank}: forward of {self.chunk_name} while its parameters are {state}")

    # ---- collectives ---------------------------------------------------------------------------
    def _wait(self, work: Any, op: str) -> None:
        try:
            work.wait(timeout=self.timeout)
        except RuntimeError as exc:
            ranks = dist.get_process_group_ranks(self.group) if self.group is not dist.group.WORLD else "world"
            raise FsdpTimeoutError(
                f"rank {self.global_rank}: FSDP {op} of {self.chunk_name} over ranks {ranks} did not complete "
                f"within {self.timeout.total_seconds():g}s (a peer skipped or reordered this collective?): {exc}"
            ) from exc

    def retire_completed_reductions(self) -> None:
        """Finish every gradient reduction of this rank's chunks (those sharing ``memory``) that has completed:
        their full gradient buffers are freed as soon as possible, not only at the chunk's next gradient."""
        for chunk in list(self.memory.reducing):
            work = chunk._reduce_work
            if work is not None and work.is_completed():
                chunk.finish_grad_reduce()

    def unshard(self, async_op: bool = False) -> None:
        """Allocate the full parameter buffer and all-gather the shards into it (no-op if unsharded)."""
        self.retire_completed_reductions()
        if self._unsharded:
            if not async_op:
                self.wait_unshard()
            return
        _alloc(self._flat, self.padded_numel)
        self.memory.add("full_params", self.full_param_bytes)
        source = self.main_shard.detach()
        if source.dtype != self.param_dtype:
            source = source.to(self.param_dtype)
        self._gather_work = _all_gather(self._flat, source, group=self.group, async_op=True)
        self._unsharded = True
        self.counters.all_gathers += 1
        self.counters.total_all_gathers += 1
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        if not self._unsharded:
            raise FsdpError(f"rank {self.global_rank}: wait_unshard of {self.chunk_name} without unshard")
        if self._gather_work is not None:
            work, self._gather_work = self._gather_work, None
            self._wait(work, "all-gather (unshard)")

    def reshard(self) -> None:
        """Free the full parameter buffer (no-op if sharded). Saved views see the data of the next unshard."""
        self.retire_completed_reductions()
        if not self._unsharded:
            return
        if self._gather_work is not None:
            raise FsdpError(f"rank {self.global_rank}: reshard of {self.chunk_name} while its all-gather is pending")
        _free(self._flat)
        self.memory.add("full_params", -self.full_param_bytes)
        self._unsharded = False

    # ---- gradients -----------------------------------------------------------------------------
    def ensure_grad_buffer(self) -> None:
        """Allocate (zeroed) the full gradient buffer; done at the first gradient after a reduction.

        A reduction of the chunk still in flight is waited for first (it reads the buffer). With
        ``gradient_accumulation_fusion`` megatron's kernel writes into ``main_grad`` directly: call this
        before the chunk's first backward op.
        """
        self.retire_completed_reductions()
        if self._reduce_work is not None:
            self.finish_grad_reduce()
        if not _is_allocated(self._grad_flat):
            _alloc(self._grad_flat, self.padded_numel)
            self._grad_flat.zero_()
            self.memory.add("full_grads", self.full_grad_bytes)

    def _make_grad_hook(self, name: str) -> Any:
        # The hook reaches its chunk through a weak reference: torch keeps a tensor's post-accumulate-grad
        # hooks where the cycle collector does not look (torch 2.13), so a hook holding the chunk strongly
        # would keep the chunk, its module and every process group they reference alive forever.
        chunk_ref = weakref.ref(self)

        def hook(param: torch.Tensor) -> None:
            # megatron DDP's rule (distributed_data_parallel.py, _make_backward_post_hook).
            chunk = chunk_ref()
            if param.grad is None or chunk is None:
                return
            chunk.ensure_grad_buffer()
            if not getattr(param, "grad_added_to_main_grad", False) or getattr(param, "zero_out_wgrad", False):
                param.main_grad.add_(param.grad)  # type: ignore[attr-defined]
            param.grad = None

        return hook

    def start_grad_reduce(self) -> None:
        """Extra all-reduces (if any), then start the reduce-scatter of the full gradient into the shard
        (the iteration's first reduction) or into a scratch shard added at :meth:`finish_grad_reduce`."""
        self.ensure_grad_buffer()  # waits for a reduction in flight; without gradients the chunk joins with zeros
        views = dict(zip(self._names, (p.main_grad for p in self._params), strict=True))  # type: ignore[attr-defined]
        for pname, group in self.extra_grad_reductions.items():
            if callable(group) and not isinstance(group, dist.ProcessGroup):
                group(views[pname])
                continue
            work = dist.all_reduce(views[pname], group=group, async_op=True)
            self._wait(work, f"all-reduce of {pname} (extra_grad_reductions)")
            self.counters.extra_all_reduces += 1
        if self.average and self.world > 1:
            self._grad_flat.mul_(1.0 / self.world)
        target = self._grad_shard
        if self._reductions > 0:  # accumulate into the sharded gradient of the earlier units
            self._scratch = target = torch.empty_like(self._grad_shard)
            self.memory.add("shard", self.shard_numel * 4)
        self._reduce_work = _reduce_scatter(
            target, self._grad_flat, op=dist.ReduceOp.SUM, group=self.group, async_op=True
        )
        self.memory.reducing.append(self)
        self._reductions += 1
        self.counters.reduce_scatters += 1
        self.counters.total_reduce_scatters += 1

    def finish_grad_reduce(self) -> None:
        """Wait for the reduce-scatter, free the full gradient buffer, add the result into the sharded
        gradient (a later reduction of the iteration), expose the shard to the optimizer."""
        if self._reduce_work is None:
            raise FsdpError(f"rank {self.global_rank}: finish_grad_reduce of {self.chunk_name} without start")
        work, self._reduce_work = self._reduce_work, None
        self.memory.reducing.remove(self)
        self._wait(work, "reduce-scatter (gradients)")
        _free(self._grad_flat)
        self.memory.add("full_grads", -self.full_grad_bytes)
        if self._scratch is not None:
            self._grad_shard.add_(self._scratch)
            self._scratch = None
            self.memory.add("shard", -self.shard_numel * 4)
        self.main_shard.grad = self._grad_shard

    # ---- iteration boundaries --------------------------------------------------------------------
    def start_iteration(self) -> None:
        """Before the iteration's first op: reset per-iteration counters and the reduced flag."""
        if self._gather_work is not None or self._reduce_work is not None:
            raise FsdpError(f"rank {self.global_rank}: {self.chunk_name} starts an iteration with a pending collective")
        if self._unsharded:
            raise FsdpError(
                f"rank {self.global_rank}: {self.chunk_name} starts an iteration unsharded: reshard every chunk "
                "before the optimizer step, the next unshard gathers the updated shards"
            )
        self._reductions = 0
        self.counters.all_gathers = 0
        self.counters.reduce_scatters = 0
        self.counters.extra_all_reduces = 0
        for p in self._params:
            p.grad_added_to_main_grad = False  # type: ignore[attr-defined]

    def end_iteration(self) -> None:
        """After the iteration's last op, before the optimizer step: every collective done, chunk sharded."""
        problems = []
        if self._reductions == 0:
            problems.append("its gradients were never reduced (start/finish_grad_reduce)")
        elif self.grad_buffer_allocated and self._reduce_work is None:
            problems.append("it holds gradients from after its last reduction (a gradient op after the last reduce)")
        if self._unsharded:
            problems.append("it is still unsharded (reshard)")
        if self._gather_work is not None or self._reduce_work is not None:
            problems.append("a collective is pending")
        if problems:
            raise FsdpError(f"rank {self.global_rank}: {self.chunk_name} ends the iteration but " + "; ".join(problems))

    # ---- optimizer -----------------------------------------------------------------------------
    def optimizer_params(self) -> list[torch.Tensor]:
        """The tensors an optimizer updates (``torch.optim.Adam(chunk.optimizer_params())``)."""
        return [self.main_shard]

    def local_grad_sq_norm(self) -> torch.Tensor:
        """Sum of squares of this rank's reduced gradient shard (padding is zero).

        For gradient clipping: all-reduce the sum over all chunks of a rank over the data-parallel and
        pipeline groups, then scale the shards' ``.grad`` by ``min(1, max_norm / sqrt(total))``.
        """
        return self._grad_shard.double().pow(2).sum()

    @property
    def reduce_started(self) -> bool:
        """Whether a reduction of this iteration has started (the schedule reduced the chunk at least once)."""
        return self._reductions > 0

    @property
    def reduce_pending(self) -> bool:
        return self._reduce_work is not None

    # ---- verification helpers (collectives: every rank of the group calls them) -------------------
    def _gather_flat(self, shard: torch.Tensor) -> torch.Tensor:
        full = torch.empty(self.padded_numel, dtype=shard.dtype, device=shard.device)
        work = _all_gather(full, shard.detach().contiguous(), group=self.group, async_op=True)
        self._wait(work, "all-gather (verification)")
        return full

    def _split(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {
            n: flat[off : off + p.numel()].view(p.shape).clone()
            for n, p, off in zip(self._names, self._params, self._offsets, strict=True)
        }

    def gather_full_params(self) -> dict[str, torch.Tensor]:
        """fp32 full parameters gathered from the shards (not counted as unshards)."""
        return self._split(self._gather_flat(self.main_shard))

    def gather_full_grads(self) -> dict[str, torch.Tensor]:
        """The reduced gradients, gathered from the gradient shards."""
        return self._split(self._gather_flat(self._grad_shard))

    def shard_of(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """This rank's slice of the flat, padded concatenation of full tensors given by name."""
        flat = torch.zeros(self.padded_numel, dtype=torch.float32, device=self.main_shard.device)
        for n, p, off in zip(self._names, self._params, self._offsets, strict=True):
            flat[off : off + p.numel()] = tensors[n].detach().reshape(-1).to(torch.float32)
        lo = self.rank * self.shard_numel
        return flat[lo : lo + self.shard_numel].clone()

    def sharded_names(self) -> Iterator[str]:
        return iter(self._names)

    def shard_mask(self, select: Callable[[str, torch.Tensor], bool]) -> torch.Tensor:
        """Boolean mask over this rank's shard: True where the element belongs to a parameter ``select(name, param)``
        accepts (per-parameter optimizer settings such as weight decay on a flat shard; padding is False)."""
        flat = torch.zeros(self.padded_numel, dtype=torch.bool, device=self.main_shard.device)
        for n, p, off in zip(self._names, self._params, self._offsets, strict=True):
            if select(n, p):
                flat[off : off + p.numel()] = True
        lo = self.rank * self.shard_numel
        return flat[lo : lo + self.shard_numel].clone()

    def main_grad_of(self, name: str) -> torch.Tensor:
        """The full-gradient view of one parameter (allocating the buffer if needed)."""
        self.ensure_grad_buffer()
        return self._params[self._names.index(name)].main_grad  # type: ignore[attr-defined,no-any-return]


def tied_embedding_reductions(module: Any, embedding_group: Any) -> dict[str, Any]:
    """``extra_grad_reductions`` for megatron's tied word embedding on the first and last stage.

    megatron's ``finalize_model_grads`` all-reduces the shared embedding/output weight's ``main_grad``
    over the embedding group (first and last pipeline stage) after the data-parallel reduction; summing
    before the reduce-scatter is the same sum. Returns ``{}`` when the chunk holds no shared weight or
    holds both ends itself (one parameter, nothing to sync).
    """
    gpt = module
    while hasattr(gpt, "module"):
        gpt = gpt.module
    if not getattr(gpt, "share_embeddings_and_output_weights", False):
        return {}
    if getattr(gpt, "pre_process", False) and getattr(gpt, "post_process", False):
        return {}
    if getattr(gpt, "pre_process", False):
        return {"embedding.word_embeddings.weight": embedding_group}
    if getattr(gpt, "post_process", False):
        return {"output_layer.weight": embedding_group}
    return {}


def add_tied_grads_locally(a: ShardedChunk, name_a: str, b: ShardedChunk, name_b: str) -> None:
    """Tied embedding with both ends on this rank (V-shape): both copies get the summed gradient.

    The local equivalent of megatron's embedding-group all-reduce. Call it after the last backward
    (and W) of *both* chunks and before either chunk's :meth:`ShardedChunk.start_grad_reduce`: the
    loss-side chunk therefore keeps its full gradient until the embedding-side chunk's backward ends.
    """
    ga, gb = a.main_grad_of(name_a), b.main_grad_of(name_b)
    ga.add_(gb)
    gb.copy_(ga)


def finalize_sharded_grads(model: list[Any], num_tokens: Any = None, **_ignored: Any) -> None:
    """``config.finalize_model_grads_func`` for sharded chunks (megatron's own calls ``finish_grad_sync``).

    Starts the reduction of any chunk the schedule did not reduce yet, waits for all of them and
    checks every chunk ends the iteration sharded. ``num_tokens`` (per-token loss) is not supported.
    """
    if num_tokens is not None:
        raise FsdpError("finalize_sharded_grads: calculate_per_token_loss is not supported with FSDP chunks")
    chunks = [c for c in model if isinstance(c, ShardedChunk)]
    for chunk in chunks:
        if not chunk.reduce_started:
            chunk.start_grad_reduce()
    for chunk in chunks:
        if chunk.reduce_pending:
            chunk.finish_grad_reduce()
        chunk.end_iteration()
