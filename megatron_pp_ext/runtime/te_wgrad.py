"""Transformer Engine adapter for the B/W split.

Supported: Transformer Engine 2.10 .. 2.18 and main (read at 2.20.0.dev0, commit d0067d0); megatron-core
0.19.2's TE wrappers. Below 2.10 ``need_backward_dw()`` does not exist; :func:`te_support_problem` refuses it.
What each piece follows in TE's source (``transformer_engine/pytorch/...``):

* **Deferral switch.** ``module/linear.py`` ``Linear.__init__`` (likewise ``layernorm_linear.py``,
  ``layernorm_mlp.py``, ``grouped_linear.py``) takes ``delay_wgrad_compute`` and builds
  ``self.wgrad_store = WeightGradStore(delay_wgrad_compute, ...)`` (``module/_common.py``); with it on,
  it marks its weights and biases ``skip_backward_post_hook``. There is no ``delay_wgrad_compute``
  attribute on the module. megatron-core 0.19.2 passes the argument only when ``config.delay_wgrad_compute``,
  which ``TransformerConfig.__post_init__`` ties to ``overlap_moe_expert_parallel_comm`` (an assertion).
  :func:`patch_for_split` therefore makes ``delay_wgrad_compute=True`` the default of TE's layer classes
  while a split schedule is installed, and leaves megatron's config alone.
* **Discovery.** ``module/base.py`` ``need_backward_dw()``: ``wgrad_store is not None and
  wgrad_store.delay_wgrad_compute()``. :func:`deferring_modules` asks every module of a chunk exactly that.
* **B.** With deferral on, the layer's backward (``module/linear.py`` ``_linear_backward``; same pattern in
  the other layers) computes the input gradient, ``wgrad_store.put([inputs, grad_output], wgrad_gemm)``
  and returns no weight gradient, or under ``fuse_wgrad_accumulation`` with megatron's
  ``grad_added_to_main_grad`` attribute a dummy one (``module/base.py`` ``get_dummy_wgrad``).
* **W.** ``module/base.py`` ``backward_dw()`` pops the oldest entry (a FIFO per module:
  ``module/_common.py`` ``WeightGradStore.pop``), runs the GEMM, *assigns* ``weight.grad`` unless
  ``fuse_wgrad_accumulation`` (then the GEMM accumulated into ``main_grad``), sets ``bias.grad`` only if it
  is None, and calls the hooks given to ``register_wgrad_accumulation_and_reduce_hooks``
  (``_trigger_wgrad_accumulation_and_reduce_hooks``). ``layernorm_mlp.py`` pops two entries (fc2, fc1);
  ``grouped_linear.py`` returns silently when its queue is empty.
* **GroupedLinear.** ``module/grouped_linear.py`` ``_GroupedLinear.backward`` queues
  ``[inputmats, grad_output, wgrad_list]`` (three lists, one tensor per expert) with the grouped GEMM, which
  writes into ``wgrad_list``: buffers B allocates (``wgrad_packed``; under fused accumulation the weights'
  ``main_grad``). Unfused, B hands autograd those still-unwritten buffers as the weights' gradients; W's
  ``backward_dw`` assigns ``weight{i}.grad`` anew, so under megatron DDP (hooks on the module) that is
  harmless, and without DDP hooks :class:`TEDeferral` puts back the weight gradients B disturbed.
* **Where the gradient lands.** megatron-core's ``distributed/distributed_data_parallel.py``: with
  ``ddp_config.delay_wgrad_compute`` it registers the grad-ready hook of every ``skip_backward_post_hook``
  parameter on its TE module instead of on the parameter's autograd accumulator, so TE's ``backward_dw``
  adds ``.grad`` to ``main_grad`` (unless ``grad_added_to_main_grad``) and marks the parameter ready for
  its bucket, once per call. :func:`patch_for_split` turns that DDP option on (it only affects parameters
  TE marked). Without megatron DDP (plain modules) the adapter accumulates the assigned ``.grad`` itself.
* **megatron's wrapper.** megatron-core 0.19.2's ``extensions/transformer_engine.py`` overrides
  ``backward_dw`` as ``if self.config.delay_wgrad_compute: super().backward_dw()`` (a no-op for us);
  :func:`te_backward_dw` calls the first ``backward_dw`` of the class hierarchy not defined by megatron.

Verified on CPU against the stand-in in ``tests/runtime/te_standin.py`` (which mirrors those functions)
under megatron DDP; verified on real TE only where ``tests/gpu`` has run (docs/megatron.md, "The B/W split").
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import weakref
from collections import deque
from typing import Any

from .wgrad import WeightGradError, WeightGradStore

MIN_TE_VERSION = (2, 10)
SUPPORTED_TE = "2.10 .. 2.18 and main"
TE_LAYER_CLASSES = ("Linear", "LayerNormLinear", "LayerNormMLP", "GroupedLinear")
TE_LAYER_METHODS = ("need_backward_dw", "backward_dw", "register_wgrad_accumulation_and_reduce_hooks")
ALTERNATIVES = "use --transformer-impl local, or an unsplit schedule (gpipe, 1f1b, interleaved-1f1b)"


class TEUnsupportedError(WeightGradError):
    """The installed Transformer Engine cannot run the B/W split."""


# ---- version and API gate -------------------------------------------------------------------------
def parse_version(version: str) -> tuple[int, ...]:
    """``"2.10.0+cu12"`` -> ``(2, 10, 0)`` (digits of the release part only)."""
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(ch for ch in piece if ch.isdigit()) if piece[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def te_api_problem(te_pytorch: Any) -> str | None:
    """What TE's layer classes lack for the split (None: nothing); ``te_pytorch``: ``transformer_engine.pytorch``."""
    found = 0
    for name in TE_LAYER_CLASSES:
        cls = getattr(te_pytorch, name, None)
        if cls is None:
            continue
        found += 1
        missing = [m for m in TE_LAYER_METHODS if not callable(getattr(cls, m, None))]
        if "delay_wgrad_compute" not in inspect.signature(cls.__init__).parameters:
            missing.append("__init__(delay_wgrad_compute=...)")
        if missing:
            return f"transformer_engine.pytorch.{name} has no {', '.join(missing)}"
    if not found:
        return f"transformer_engine.pytorch has none of {', '.join(TE_LAYER_CLASSES)}"
    return None


def te_support_problem(version: str | None = None, te_pytorch: Any = None) -> str | None:
    """Why the installed TE (or the given version / module) cannot run the split, or ``None``."""
    if version is None or te_pytorch is None:
        try:
            import transformer_engine  # type: ignore[import-not-found]
            import transformer_engine.pytorch as te_pt  # type: ignore[import-not-found]
        except Exception as exc:  # not installed, or installed without CUDA / cuDNN
            return f"Transformer Engine is not importable ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})"
        version = version or str(getattr(transformer_engine, "__version__", "0"))
        te_pytorch = te_pytorch or te_pt
    if parse_version(version) < MIN_TE_VERSION:
        return f"Transformer Engine {version} found, the B/W split needs >= {'.'.join(map(str, MIN_TE_VERSION))}"
    problem = te_api_problem(te_pytorch)
    return f"Transformer Engine {version}: {problem}" if problem else None


def refusal(problem: str, schedule: str) -> str:
    """The one line printed when a split schedule cannot run on the installed TE."""
    return (
        f"{problem} (supported: {SUPPORTED_TE}); schedule {schedule} splits the backward into B and W, "
        f"which the Transformer Engine layer spec cannot do here: {ALTERNATIVES}"
    )


def check_te_support(schedule: str, version: str | None = None, te_pytorch: Any = None) -> None:
    """Raise :class:`TEUnsupportedError` with :func:`refusal` when TE cannot run the split."""
    problem = te_support_problem(version, te_pytorch)
    if problem is not None:
        raise TEUnsupportedError(refusal(problem, schedule))


# ---- TE modules: discovery, their queue, their own backward_dw -------------------------------------
def deferring_modules(model_chunk: Any) -> list[Any]:
    """Modules of a chunk that defer their weight gradient, asked as TE asks (``need_backward_dw()``)."""
    found = []
    for module in model_chunk.modules():
        need = getattr(module, "need_backward_dw", None)
        if callable(need) and need():
            found.append(module)
    return found


def te_queue_size(module: Any) -> int:
    """Entries in a TE module's own weight-gradient FIFO (``wgrad_store.context``, a ``queue.Queue``)."""
    context = getattr(getattr(module, "wgrad_store", None), "context", None)
    if context is None:
        raise WeightGradError(f"{type(module).__name__}: Transformer Engine wgrad_store has no queue (context)")
    return int(context.qsize())


def te_backward_dw(module: Any) -> None:
    """TE's own ``backward_dw`` of ``module``, skipping megatron's config-gated overrides."""
    for cls in type(module).__mro__:
        method = cls.__dict__.get("backward_dw")
        if method is not None and not cls.__module__.startswith("megatron."):
            method(module)
            return
    raise WeightGradError(f"{type(module).__name__} has no Transformer Engine backward_dw")


def _deferred_params(module: Any) -> list[Any]:
    # TE marks exactly the parameters whose gradient backward_dw produces (module/linear.py __init__).
    return [p for p in module.parameters() if getattr(p, "skip_backward_post_hook", False)]


_WEIGHT_NAME = re.compile(r"(\w+_)?weight\d*")  # weight, fc1_weight, weight0 .. weight{num_gemms-1}


def _unhooked_weights(module: Any) -> list[Any]:
    """Deferred weights of a TE layer without megatron DDP's hooks: B must leave their ``.grad`` alone.

    ``GroupedLinear``'s B returns its unwritten ``wgrad_list`` buffers to autograd (module docstring);
    ``Linear`` and ``LayerNormMLP`` return None, so keeping their ``.grad`` across B changes nothing.
    Biases are not included: with ``return_bias`` their gradient legitimately arrives through autograd.
    """
    if getattr(module, "wgrad_accumulation_and_reduce_hooks", None):
        return []
    return [
        p
        for name, p in module.named_parameters(recurse=False)
        if getattr(p, "skip_backward_post_hook", False) and _WEIGHT_NAME.fullmatch(name)
    ]


def run_backward_dw(module: Any) -> None:
    """One TE ``backward_dw`` of ``module``, its weight gradient delivered where the optimizer reads it.

    Under megatron DDP built with ``ddp_config.delay_wgrad_compute`` (see :func:`patch_for_split`), TE calls
    DDP's hooks itself. Without DDP hooks, TE *assigns* ``.grad`` (and keeps an existing bias grad), so the
    adapter stashes the accumulated gradient around the call and adds TE's result to it.
    """
    if getattr(module, "wgrad_accumulation_and_reduce_hooks", None):
        given = _restore_dummy_wgrads(module) if getattr(module, "fuse_wgrad_accumulation", False) else []
        te_backward_dw(module)
        for p, dummy in given:  # a hook that did not clear it (parameter outside DDP's buckets): take it back
            if p.grad is not None and p.grad.data_ptr() == dummy.data_ptr():
                p.grad = None
        return
    params = _deferred_params(module)
    if any(hasattr(p, "main_grad") for p in params):
        raise WeightGradError(
            f"{type(module).__name__}: megatron DDP was built without ddp_config.delay_wgrad_compute, so it "
            "watches this layer's parameters in B, where Transformer Engine delivers no weight gradient; build "
            "the model after megatron_pp_ext.install() (it turns that option on for split schedules)"
        )
    saved = [p.grad for p in params]
    for p in params:
        p.grad = None
    te_backward_dw(module)
    for p, old in zip(params, saved, strict=True):
        new = p.grad
        p.grad = old if new is None else (new if old is None else old + new)


_ZERO_DUMMIES: dict[tuple[Any, ...], Any] = {}


def _restore_dummy_wgrads(module: Any) -> list[tuple[Any, Any]]:
    """Give fused-accumulation weights the dummy ``.grad`` megatron's DDP hook expects in W.

    Under ``fuse_wgrad_accumulation`` TE's B hands autograd a dummy weight gradient (``module/linear.py``,
    ``get_dummy_wgrad``) that lands in ``weight.grad``; megatron's hook, called from ``backward_dw``, discards
    it (``grad_added_to_main_grad``) and sets ``.grad = None``, but asserts it is present under
    ``overlap_grad_reduce``. With several micro-batches' B's before their W's (B0 B1 W0 B2 W1 W2), W0's hook
    clears the dummies of B0 and B1 together and W2 would find none. A zero dummy is what TE would have
    handed over (``zero_out_wgrad`` semantics) and is never added to ``main_grad`` otherwise.
    """
    given = []
    for p in _deferred_params(module):
        if p.grad is None and getattr(p, "grad_added_to_main_grad", False):
            key = (tuple(p.shape), p.dtype, p.device)
            dummy = _ZERO_DUMMIES.get(key)
            if dummy is None:
                import torch

                dummy = _ZERO_DUMMIES[key] = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
            p.grad = dummy.detach()
            given.append((p, dummy))
    return given


class TEDeferral:
    """A :class:`~megatron_pp_ext.runtime.wgrad.DeferralProvider` for Transformer Engine layers.

    B of ``(chunk, micro-batch)``: the TE layers queued their GEMMs in their own FIFOs; the adapter records
    how many entries each layer added and queues one closure in our store. W runs it: ``backward_dw`` on
    each layer as often as the chunk's oldest B still waiting for its W added entries to it. TE can only pop
    the oldest entry, so a W that comes out of B order (zb-h1's later ranks run their first W last) computes
    the older micro-batch's GEMMs and the later W the rest: every entry is consumed once, in B order, so
    each ``main_grad`` receives the same sums in the same order as in the unsplit backward. A full backward
    (``BW`` op) of a chunk with TE layers runs the same right after the backward, since the layers defer
    regardless of the op.
    """

    def __init__(self) -> None:
        # chunk -> per B whose W has not run, oldest first: the entries it added to each TE layer
        self._pending: dict[int, deque[list[tuple[Any, int]]]] = {}
        self._modules: weakref.WeakKeyDictionary[Any, list[Any]] = weakref.WeakKeyDictionary()
        self._before: weakref.WeakKeyDictionary[Any, list[int]] = weakref.WeakKeyDictionary()
        self._kept: weakref.WeakKeyDictionary[Any, list[tuple[Any, Any]]] = weakref.WeakKeyDictionary()

    def applies_to(self, model_chunk: Any) -> bool:
        modules = self._modules.get(model_chunk)
        if modules is None:
            modules = self._modules[model_chunk] = deferring_modules(model_chunk)
        return bool(modules)

    def before_backward(self, chunk: int, microbatch: int, model_chunk: Any) -> None:
        modules = self._modules[model_chunk]
        self._before[model_chunk] = [te_queue_size(m) for m in modules]
        kept = self._kept[model_chunk] = [(p, p.grad) for m in modules for p in _unhooked_weights(m)]
        for p, _ in kept:  # cleared, or autograd would add B's buffer into the kept gradient in place
            p.grad = None

    def _added(self, model_chunk: Any) -> list[tuple[Any, int]]:
        modules = self._modules[model_chunk]
        before = self._before.pop(model_chunk, [0] * len(modules))
        for p, grad in self._kept.pop(model_chunk, []):
            p.grad = grad  # what B handed autograd for a deferred weight is not its gradient
        return [(m, te_queue_size(m) - b) for m, b in zip(modules, before, strict=True) if te_queue_size(m) > b]

    def after_full_backward(self, chunk: int, microbatch: int, model_chunk: Any) -> None:
        _consume(self._added(model_chunk), chunk, microbatch)

    def after_input_grad(self, chunk: int, microbatch: int, model_chunk: Any, store: WeightGradStore) -> None:
        added = self._added(model_chunk)
        pending = self._pending.setdefault(chunk, deque())
        pending.append(added)

        def run() -> None:
            _consume(pending.popleft(), chunk, microbatch)  # the oldest B's entries: what TE pops first

        store.put(run, sum(_held_bytes(m, n) for m, n in added))


def _consume(added: list[tuple[Any, int]], chunk: int, microbatch: int) -> None:
    for module, entries in reversed(added):  # reverse module order, as autograd would reach them
        while entries > 0:
            size = te_queue_size(module)
            run_backward_dw(module)
            popped = size - te_queue_size(module)
            if popped <= 0:
                raise WeightGradError(
                    f"chunk {chunk} micro-batch {microbatch}: backward_dw() of {type(module).__name__} computed "
                    f"nothing ({entries} queued weight-gradient entries left)"
                )
            entries -= popped


def _held_bytes(module: Any, entries: int) -> int:
    queued = list(getattr(module.wgrad_store.context, "queue", []))[-entries:]
    total = 0
    for tensors, _func in queued:
        for t in _flat(tensors):
            storage = getattr(t, "untyped_storage", None)
            total += storage().nbytes() if storage is not None else 0
    return total


def _flat(items: Any) -> list[Any]:
    # GroupedLinear's entry holds lists of per-expert tensors (None where a list has no tensor)
    out = []
    for item in items:
        out.extend(_flat(item) if isinstance(item, (list, tuple)) else [item])
    return out


def pending_te_entries(model_chunk: Any) -> list[tuple[str, int]]:
    """``(module name, queued entries)`` of every TE layer of a chunk whose FIFO is not empty."""
    return [
        (name or type(m).__name__, te_queue_size(m))
        for name, m in model_chunk.named_modules()
        if callable(getattr(m, "need_backward_dw", None)) and m.need_backward_dw() and te_queue_size(m)
    ]


def enable_te_wgrad(store: WeightGradStore | None = None) -> TEDeferral:
    """Register the TE provider with the weight-gradient store (idempotent)."""
    from .wgrad import get_weight_grad_store

    store = store or get_weight_grad_store()
    for provider in store.providers:
        if isinstance(provider, TEDeferral):
            return provider
    provider = TEDeferral()
    store.providers.append(provider)
    return provider


# ---- install-time patches ---------------------------------------------------------------------------
def patch_for_split(patcher: Any, layer_classes: list[type] | None = None, ddp_class: Any = None) -> None:
    """While a split schedule is installed: TE layers defer by default, megatron DDP hooks TE layers.

    ``layer_classes``: TE's ``Linear``, ``LayerNormLinear``, ``LayerNormMLP``, ``GroupedLinear`` by default
    (megatron's wrappers subclass them and pass their own kwargs through ``super().__init__``);
    ``ddp_class``: megatron-core's ``DistributedDataParallel``. ``patcher.restore()`` undoes both.
    """
    if layer_classes is None:
        import transformer_engine.pytorch as te_pt  # type: ignore[import-not-found]

        layer_classes = [getattr(te_pt, n) for n in TE_LAYER_CLASSES if hasattr(te_pt, n)]
    if ddp_class is None:
        from megatron.core.distributed import DistributedDataParallel

        ddp_class = DistributedDataParallel
    for cls in layer_classes:
        _wrap_init(patcher, cls, _defer_by_default)
    _wrap_init(patcher, ddp_class, _ddp_hooks_te_layers)


def _defer_by_default(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return args, {**kwargs, "delay_wgrad_compute": kwargs.get("delay_wgrad_compute", True)}


def _ddp_hooks_te_layers(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    # DistributedDataParallel.__init__(self, config, ddp_config, module, ...)
    if "ddp_config" in kwargs:
        kwargs = {**kwargs, "ddp_config": dataclasses.replace(kwargs["ddp_config"], delay_wgrad_compute=True)}
    elif len(args) > 2:
        args = (*args[:2], dataclasses.replace(args[2], delay_wgrad_compute=True), *args[3:])
    return args, kwargs


def _wrap_init(patcher: Any, cls: type, adjust: Any) -> None:
    if getattr(cls.__dict__.get("__init__"), "megatron_pp_ext", False):
        return  # already wrapped
    had_own = "__init__" in cls.__dict__
    original = cls.__dict__["__init__"] if had_own else cls.__init__

    def init(*args: Any, **kwargs: Any) -> None:
        args, kwargs = adjust(args, kwargs)
        original(*args, **kwargs)

    init.__wrapped__ = original  # type: ignore[attr-defined]
    init.megatron_pp_ext = True  # type: ignore[attr-defined]
    cls.__init__ = init  # type: ignore[misc]

    def undo() -> None:
        if had_own:
            cls.__init__ = original  # type: ignore[misc]
        else:
            del cls.__init__

    patcher.on_restore(undo)
