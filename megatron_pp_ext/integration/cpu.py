"""CPU / gloo mode: run megatron-core's real pipeline machinery without a GPU.

Everything here is a shim for a machine with no CUDA (laptops, CI). It is never
active in a CUDA run: :func:`enable_cpu_mode` refuses to patch when CUDA is
available unless ``force=True``. Import this module and call
:func:`enable_cpu_mode` on every rank *before* importing megatron.

What it does (docs/architecture.md, "CPU / gloo mode"):

1. stubs ``megatron.core.transformer.moe.ops.paged_stash`` (an unconditional
   ``import triton``);
2. maps CUDA allocations to CPU (a ``TorchFunctionMode`` rewriting ``device=``
   arguments; ``Tensor.cuda()`` returns the tensor); ``torch.cuda.current_device()``
   returns 0 and ``device_count()`` 1;
3. makes ``torch.cuda.synchronize`` / ``empty_cache`` / ``set_device`` no-ops;
4. gives ``torch.cuda.current_stream()``, ``Stream`` and ``Event`` null objects (and makes
   ``Tensor.record_stream`` a no-op: megatron's schedule-plan nodes call it);
5. points megatron's CUDA RNG tracker at the CPU generator;
6. defines ``typing.override`` on Python 3.11 (``megatron.training`` uses it; 3.12 has its own, kept);
7. makes the tensor-parallel all-reduce return a fresh tensor, never its input (MoE experts add
   their bias in place into it; :func:`_patch_reduce_from_model_parallel_region` says why that is exact);
8. gives megatron's MoE token dispatcher its all-to-all split sizes as host arrays, as on a GPU
   (:func:`_patch_moe_split_sizes`);
9. makes the C allocator keep freed large buffers for reuse, as a GPU's caching allocator does
   (:mod:`megatron_pp_ext.integration.cpu_allocator` says why op costs depend on it);
10. runs the communication-stream nodes of megatron's combined forward-backward step on a worker
   thread, the CPU's stand-in for a CUDA stream (:mod:`megatron_pp_ext.integration.cpu_streams`);
11. runs megatron's ``custom_backward`` (its backward step's direct call of the autograd engine) with the
   mode of item 2 taken off, as ``torch.autograd.backward`` runs the engine: otherwise every torch call
   of megatron's Python backward functions passes through the mode (:func:`_patch_custom_backward`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import sys
import types
import typing
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from . import cpu_streams
from .cpu_allocator import keep_freed_buffers

_ENABLED = False
_MODE: TorchFunctionMode | None = None


def cuda_available() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - broken driver installs
        return False


def is_enabled() -> bool:
    return _ENABLED


def _cpu_device(device: Any) -> Any:
    if isinstance(device, int) and not isinstance(device, bool):
        return torch.device("cpu")
    if isinstance(device, str) and device.startswith("cuda"):
        return torch.device("cpu")
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("cpu")
    return device


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites ``device=cuda`` / integer devices to CPU in every torch call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        if func in (torch.Tensor.to,) and args:
            args = tuple(_cpu_device(a) if i > 0 else a for i, a in enumerate(args))
        return func(*args, **kwargs)


class _NullStream:
    """Stands in for ``torch.cuda.Stream`` on CPU: every operation is immediate."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def wait_stream(self, *args: object) -> None:
        pass

    def wait_event(self, *args: object) -> None:
        pass

    def record_event(self, event: object = None) -> _NullEvent:
        return _NullEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> _NullStream:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


class _NullEvent:
    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def record(self, *args: object) -> None:
        pass

    def wait(self, *args: object) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: object) -> float:
        return 0.0


_FACTORIES = ("empty", "zeros", "ones", "full", "rand", "randn", "randint", "arange", "tensor", "empty_strided")
_TENSOR_FACTORIES = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")


def _patch_factories() -> None:
    """Map ``device=cuda`` in torch's factory functions to CPU.

    The ``TorchFunctionMode`` does not reach code that runs inside autograd's
    backward (e.g. megatron's sequence-parallel reduce-scatter buffers, its MoE
    all-to-all's output buffer), so the factories and tensor methods megatron calls
    with ``device=torch.cuda.current_device()`` are wrapped as well.
    """
    for owner, names in ((torch, _FACTORIES), (torch.Tensor, _TENSOR_FACTORIES)):
        for name in names:
            original = getattr(owner, name)
            if getattr(original, "_megatron_pp_cpu", False):
                continue

            # a tensor method gets its tensor as the first positional argument
            def wrapper(*args: Any, __original: Any = original, **kwargs: Any) -> Any:
                if "device" in kwargs:
                    kwargs["device"] = _cpu_device(kwargs["device"])
                return __original(*args, **kwargs)

            wrapper._megatron_pp_cpu = True  # type: ignore[attr-defined]
            wrapper.__name__ = name
            wrapper.__doc__ = original.__doc__
            setattr(owner, name, wrapper)


class _DoneWork:
    """A completed collective (returned for ``async_op=True`` by the CPU collectives below)."""

    def wait(self, *args: object) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _patch_sequence_parallel_collectives() -> None:
    """gloo-safe ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` for megatron's sequence parallelism.

    megatron gathers into views of a shared buffer, which gloo fills in place after
    the fact; with autograd enabled that raises on CPU. These versions run
    synchronously without autograd tracking; reduce-scatter is an all-reduce
    followed by taking this rank's slice (gloo has no reduce-scatter of tensors).
    """
    import torch.distributed as dist

    if getattr(dist.all_gather_into_tensor, "_megatron_pp_cpu", False):
        return
    original_gather = dist.all_gather_into_tensor

    def all_gather_into_tensor(output: Any, input: Any, group: Any = None, async_op: bool = False) -> Any:
        with torch.no_grad():
            original_gather(output, input, group=group, async_op=False)
        return _DoneWork() if async_op else None

    def reduce_scatter_tensor(
        output: Any, input: Any, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False
    ) -> Any:
        if output.untyped_storage().data_ptr() == input.untyped_storage().data_ptr():
            # In place (megatron DDP's distributed-optimizer path: the output is this rank's shard of
            # the bucket): an all-reduce of the whole input leaves the reduced shard where megatron
            # reads it, and, unlike a copy after the fact, stays right inside megatron's
            # _coalescing_manager, where gloo runs the collectives only when the block ends.
            return dist.all_reduce(input, op=op, group=group, async_op=async_op)
        with torch.no_grad():
            total = input.clone()
            dist.all_reduce(total, op=op, group=group)
            rank = dist.get_rank(group)
            output.copy_(total.chunk(dist.get_world_size(group))[rank])
        return _DoneWork() if async_op else None

    all_gather_into_tensor._megatron_pp_cpu = True  # type: ignore[attr-defined]
    reduce_scatter_tensor._megatron_pp_cpu = True  # type: ignore[attr-defined]
    dist.all_gather_into_tensor = all_gather_into_tensor  # type: ignore[assignment]
    dist.reduce_scatter_tensor = reduce_scatter_tensor  # type: ignore[assignment]


def _patch_reduce_from_model_parallel_region() -> None:
    """``_ReduceFromModelParallelRegion`` returns a copy of its result when that result is its input.

    megatron's torch ``RowParallelLinear`` ends with this autograd function, whose forward hands its
    input back unchanged at TP = 1 (and, at TP > 1, the input all-reduced in place). autograd treats
    an input returned by a custom function as a view of it, and megatron's expert MLP then adds the
    per-token-scaled bias into that output in place (``output += ...`` in ``MLP.forward``), which
    autograd forbids for such views. Transformer Engine's linears, megatron's usual GPU path, return
    a new tensor, so the in-place add never meets the view there.

    Exact: ``clone`` copies every element bit for bit, the function's backward (the identity on
    ``grad_output``) is unchanged, and the clone's own gradient is the identity, so losses and
    gradients are the same bits as without the copy. The cost is one activation-sized copy per
    row-parallel linear, in CPU mode only.
    """
    from megatron.core.tensor_parallel import mappings

    cls = mappings._ReduceFromModelParallelRegion
    if getattr(cls.forward, "_megatron_pp_cpu", False):
        return
    original = cls.forward

    def forward(ctx: Any, input_: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        output = original(ctx, input_, *args, **kwargs)
        return output.clone() if output is input_ else output

    forward._megatron_pp_cpu = True  # type: ignore[attr-defined]
    cls.forward = staticmethod(forward)  # type: ignore[method-assign,assignment]


def _patch_moe_split_sizes() -> None:
    """``maybe_move_tensor_to_cpu(t, as_numpy=True)`` returns a numpy array for a CPU tensor too.

    megatron's all-to-all token dispatcher counts tokens per expert on the device and moves the counts
    to the host with this helper, which converts to numpy only when the tensor was on CUDA; the counts
    then become ``all_to_all_single``'s split sizes, which must be a sequence of ints (a numpy array
    is, a tensor is not). On CPU the counts already are host tensors: converting them too gives the
    same integers megatron's GPU path hands the collective.
    """
    from megatron.core.transformer.moe import (
        moe_utils,
        token_dispatcher,  # noqa: F401  (holds a by-name copy)
    )

    from ._patching import replace_everywhere

    original = moe_utils.maybe_move_tensor_to_cpu
    if getattr(original, "_megatron_pp_cpu", False):
        return

    def maybe_move_tensor_to_cpu(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.detach().clone().numpy()  # a copy, as the device-to-host move makes
        return original(tensor, as_numpy=as_numpy, record_stream=record_stream)

    maybe_move_tensor_to_cpu._megatron_pp_cpu = True  # type: ignore[attr-defined]
    replace_everywhere("megatron.core.transformer.moe.moe_utils", "maybe_move_tensor_to_cpu", maybe_move_tensor_to_cpu)


def _patch_sequence_parallel_norm() -> None:
    """megatron's torch norm (the local layer spec's, used on CPU) under sequence parallelism.

    ``WrappedTorchNorm`` refuses ``sequence_parallel``: a norm applied to a rank's sequence shard gets weight
    and bias gradients from that shard only, and something must sum them over the tensor-parallel group.
    Megatron's Apex and TE norms do it by marking their weight and bias ``sequence_parallel``, which
    ``finalize_model_grads`` all-reduces over the tensor-parallel group. This builds the same torch norm and
    marks its parameters the same way: the forward is torch's, the summed gradients megatron's own.
    """
    from megatron.core.transformer import torch_norm

    original = torch_norm.WrappedTorchNorm.__new__
    if getattr(original, "_megatron_pp_cpu", False):
        return

    def new_norm(cls: Any, config: Any, *args: Any, **kwargs: Any) -> Any:
        if not config.sequence_parallel:
            return original(cls, config, *args, **kwargs)
        unsplit = copy.copy(config)  # the same config for torch's norm, which asks only this flag of it
        unsplit.sequence_parallel = False
        norm = original(cls, unsplit, *args, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    new_norm._megatron_pp_cpu = True  # type: ignore[attr-defined]
    torch_norm.WrappedTorchNorm.__new__ = new_norm  # type: ignore[method-assign,assignment]


def _stub_triton_modules() -> None:
    """megatron-core imports triton unconditionally for a MoE kernel; stub that module."""
    name = "megatron.core.transformer.moe.ops.paged_stash"
    if name in sys.modules:
        return
    try:
        import triton  # noqa: F401

        return  # the real thing is installed
    except ImportError:
        pass
    stub = types.ModuleType(name)
    stub.GLOBAL_BLOCK_SIZE = 1024  # type: ignore[attr-defined]

    def _unavailable(*args: object, **kwargs: object) -> None:
        raise RuntimeError("MoE paged stash kernels need triton and CUDA; not available in CPU mode")

    stub.paged_stash_copy_kernel = _unavailable  # type: ignore[attr-defined]
    stub.paged_stash_pop_kernel = _unavailable  # type: ignore[attr-defined]
    stub.__all__ = ["GLOBAL_BLOCK_SIZE", "paged_stash_copy_kernel", "paged_stash_pop_kernel"]  # type: ignore[attr-defined]
    sys.modules[name] = stub


def _patch_custom_backward() -> None:
    """megatron's ``backward_step`` runs the autograd engine through its own ``custom_backward`` (looked up in
    its module at every call), which the device-rewriting mode would see every torch call of; run it with that
    mode popped, as ``torch.autograd.backward`` does (the engine's calls are handled inside the mode's own
    ``__torch_function__`` there). Nothing in a backward needs the mode: the factories megatron calls are
    patched (:func:`_patch_factories`), and our ``W`` ops and megatron with ``deallocate_pipeline_outputs``
    off already run their backward through ``torch.autograd.backward``. Losses and gradients are the same
    bit for bit; it saves host time per backward on CPU only."""
    from megatron.core.pipeline_parallel import schedules

    original = schedules.custom_backward
    pop = getattr(torch.overrides, "_pop_mode_temporarily", None)
    if pop is None or getattr(original, "_megatron_pp_cpu", False):
        return

    def custom_backward(output: Any, grad_output: Any) -> Any:
        depth = torch._C._len_torch_function_stack()
        if depth == 0 or not isinstance(torch._C._get_function_stack_at(depth - 1), _CudaToCpuMode):
            return original(output, grad_output)  # our mode is not on top: leave the stack alone
        with pop():
            return original(output, grad_output)

    custom_backward._megatron_pp_cpu = True  # type: ignore[attr-defined]
    schedules.custom_backward = custom_backward


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    cuda.current_device = lambda: 0  # type: ignore[assignment]
    cuda.device_count = lambda: 1  # type: ignore[assignment]
    cuda.set_device = lambda *a, **k: None  # type: ignore[assignment]
    cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    cuda.empty_cache = lambda: None  # type: ignore[assignment]
    cuda.current_stream = lambda *a, **k: _NullStream()  # type: ignore[assignment]
    cuda.default_stream = lambda *a, **k: _NullStream()  # type: ignore[assignment]
    cuda.Stream = _NullStream  # type: ignore[assignment,misc]
    cuda.Event = _NullEvent  # type: ignore[assignment,misc]
    cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    # Megatron seeds "the CUDA generator" to build its RNG tracker states: use the CPU one.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(seed)  # type: ignore[assignment]
    cuda.manual_seed_all = lambda seed: None  # type: ignore[assignment]  (torch.manual_seed calls it)
    cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[assignment]
    cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)  # type: ignore[assignment]
    cuda.memory_allocated = lambda *a, **k: 0  # type: ignore[assignment]
    cuda.max_memory_allocated = lambda *a, **k: 0  # type: ignore[assignment]
    cuda.memory_reserved = lambda *a, **k: 0  # type: ignore[assignment]
    cuda.max_memory_reserved = lambda *a, **k: 0  # type: ignore[assignment]
    cuda.reset_peak_memory_stats = lambda *a, **k: None  # type: ignore[assignment]
    cuda.nvtx = types.SimpleNamespace(  # type: ignore[assignment]
        range_push=lambda *a, **k: None, range_pop=lambda *a, **k: None, range=contextlib.nullcontext
    )
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    # the caching allocator's "used on this stream" mark (megatron's schedule-plan nodes set it before
    # freeing an input): a CPU tensor has no stream to outlive, so there is nothing to mark
    torch.Tensor.record_stream = lambda self, stream: None  # type: ignore[method-assign,assignment]


def _patch_rng_tracker() -> None:
    """Megatron's CUDA RNG tracker keeps generator states; on CPU they are CPU states."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()  # type: ignore[attr-defined]
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)  # type: ignore[attr-defined]

    class _QuietRngWarning(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "CPU RNG state changed within GPU RNG context" not in record.getMessage()

    logging.getLogger(mrandom.__name__).addFilter(_QuietRngWarning())


def _define_typing_override() -> None:
    if not hasattr(typing, "override"):

        def override(func: Any) -> Any:
            return func

        typing.override = override  # type: ignore[attr-defined]


def enable_cpu_mode(force: bool = False, threads: int | None = None) -> bool:
    """Install the CPU shims (idempotent). Returns True when CPU mode is active.

    Refuses (returns False, patches nothing) when CUDA is available, unless ``force``.
    """
    global _ENABLED, _MODE
    if _ENABLED:
        return True
    if cuda_available() and not force:
        return False
    if threads is None:
        threads = int(os.environ.get("MEGATRON_PP_CPU_THREADS", "1"))
    if threads > 0:
        torch.set_num_threads(threads)
    keep_freed_buffers()
    _define_typing_override()
    _stub_triton_modules()
    _patch_torch_cuda()
    _patch_factories()
    _patch_sequence_parallel_collectives()
    _patch_sequence_parallel_norm()
    _MODE = _CudaToCpuMode()
    _MODE.__enter__()
    _patch_rng_tracker()
    _patch_reduce_from_model_parallel_region()
    _patch_moe_split_sizes()
    _patch_custom_backward()
    cpu_streams.patch_schedule_nodes(lambda: _CudaToCpuMode().__enter__())  # the mode is per thread
    _ENABLED = True
    return True


# ---- Megatron's own training loop (megatron.training.pretrain) on CPU ------------------------------------
_TRAINING_ENABLED = False
_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def _patch_tensor_type() -> None:
    """``Tensor.type()`` (no argument) reports the CUDA type name: megatron's optimizers and
    ``clip_grads`` compare it with ``'torch.cuda.FloatTensor'`` and friends."""
    original = torch.Tensor.type

    def type_(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
        if dtype is None and not kwargs and self.device.type == "cpu" and self.dtype in _CUDA_TYPE_NAMES:
            return _CUDA_TYPE_NAMES[self.dtype]
        if dtype is None and not kwargs:
            return original(self)
        return original(self, dtype, non_blocking, **kwargs)

    torch.Tensor.type = type_  # type: ignore[method-assign,assignment]


def enable_megatron_optimizer_on_cpu() -> None:
    """What megatron-core's optimizers (``get_megatron_optimizer``, the distributed optimizer) need
    on CPU beyond :func:`enable_cpu_mode`: CUDA type names from ``Tensor.type()``."""
    if is_enabled() and not getattr(torch.Tensor.type, "_megatron_pp_cpu", False):
        _patch_tensor_type()
        torch.Tensor.type._megatron_pp_cpu = True  # type: ignore[attr-defined]


def _patch_device_queries() -> None:
    """``torch.cuda.get_device_properties`` & co. for megatron's argument checks (TP > 1 asks for the
    device architecture). Reports a device of compute capability 10.0 (no ``CUDA_DEVICE_MAX_CONNECTIONS``
    requirement) with no memory."""
    props = types.SimpleNamespace(
        name="cpu (megatron_pp_ext CPU mode)", major=10, minor=0, total_memory=0, multi_processor_count=1
    )
    torch.cuda.get_device_properties = lambda *a, **k: props  # type: ignore[assignment]
    torch.cuda.get_device_capability = lambda *a, **k: (props.major, props.minor)  # type: ignore[assignment]
    torch.cuda.get_device_name = lambda *a, **k: props.name  # type: ignore[assignment]


def enable_cpu_training_mode(force: bool = False, threads: int | None = None, skip_jit_warmup: bool = True) -> bool:
    """:func:`enable_cpu_mode` plus what ``megatron.training.pretrain()`` needs on CPU (idempotent).

    Call it on every rank before ``pretrain()``. Returns False (patching nothing) when CUDA is
    available, unless ``force``. On top of :func:`enable_cpu_mode` it

    * makes ``initialize_megatron`` pass ``allow_no_cuda=True`` (``pretrain()`` calls it without);
    * skips megatron's dataset ``compile_helpers`` (the wheel ships the compiled helper but no
      Makefile, so ``make`` fails);
    * makes ``Tensor.type()`` report CUDA type names for CPU tensors (the optimizers and
      ``clip_grads`` assert ``torch.cuda.FloatTensor``; with it ``--clip-grad`` works on CPU);
    * skips the JIT warm-up of ``set_jit_fusion_options`` (30 s of CPU ``torch.compile``), when
      ``skip_jit_warmup``;
    * answers ``torch.cuda.get_device_properties / get_device_capability / get_device_name``
      (megatron's argument checks ask for the architecture with TP > 1).
    """
    global _TRAINING_ENABLED
    if _TRAINING_ENABLED:
        return True
    if not enable_cpu_mode(force=force, threads=threads):
        return False
    import megatron.core.datasets.utils as dataset_utils
    import megatron.training.initialize as minit
    import megatron.training.training  # noqa: F401  (so that its by-name imports get rebound)

    from ._patching import replace_everywhere

    original_init = minit.initialize_megatron

    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_no_cuda"] = True
        return original_init(*args, **kwargs)

    replace_everywhere("megatron.training.initialize", "initialize_megatron", initialize_megatron)
    dataset_utils.compile_helpers = lambda: None  # type: ignore[assignment]
    if skip_jit_warmup:
        minit._warmup_jit_function = lambda *a, **k: None  # type: ignore[attr-defined]
    _patch_tensor_type()
    _patch_device_queries()
    _TRAINING_ENABLED = True
    return True


#: megatron's import-time warnings about optional CUDA libraries: each is repeated from several modules
#: and on every rank; in CPU mode none of them is news.
MISSING_ACCELERATOR_WARNINGS = (
    r"Apex is not installed",
    r"Transformer Engine and Apex are not installed",
    r"absl\.logging is not installed",
    r"Only transformer-engine>=",
)


def hide_missing_accelerator_warnings(announce: bool = True) -> None:
    """In CPU mode: hide megatron's repeated Apex / Transformer Engine warnings and, if ``announce``,
    say once (rank 0) that their torch fallbacks are used."""
    import warnings

    for pattern in MISSING_ACCELERATOR_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    if announce and os.environ.get("RANK", "0") == "0":
        print(
            "megatron_pp_ext: CPU mode: Apex and Transformer Engine are not used (megatron falls back to torch; "
            "its warnings about them are shown only here)",
            file=sys.stderr,
            flush=True,
        )
