"""A CPU test double of the parts of Transformer Engine the B/W-split adapter relies on.

Mirrors TE main (2.20.0.dev0, commit d0067d0; the same logic since 2.10), ``transformer_engine/pytorch/``.
Each piece names the TE file and function it reproduces; FP8, userbuffers, sequence parallelism, CPU
offload and debug mode are left out. Not a copy: the GEMMs are plain matmuls and tensor-parallel
communication is a plain all-reduce.
"""

from __future__ import annotations

import queue
from typing import Any, ClassVar

import torch
import torch.distributed as dist

# module/base.py: get_dummy_wgrad() keeps one cached tensor per (shape, dtype) and hands out detached views.
_DUMMY_WGRADS: dict[tuple[Any, ...], torch.Tensor] = {}


def get_dummy_wgrad(shape: list[int], dtype: torch.dtype, zero: bool = False) -> torch.Tensor:
    key = (*shape, dtype)
    if key not in _DUMMY_WGRADS:
        _DUMMY_WGRADS[key] = torch.empty(shape, dtype=dtype)
    if zero:
        _DUMMY_WGRADS[key].fill_(0)
    return _DUMMY_WGRADS[key].detach()


class WeightGradStore:
    """module/_common.py WeightGradStore: a FIFO (``queue.Queue``) of ``[tensor_list, func]`` entries."""

    def __init__(self, delay_wgrad_compute: bool = False, ub_bulk_wgrad: bool = False) -> None:
        if delay_wgrad_compute:
            self.context: queue.Queue | None = queue.Queue()
            assert ub_bulk_wgrad is False
            self.enabled = True
        else:
            self.context = None
            self.enabled = False

    def delay_wgrad_compute(self) -> bool:
        return self.enabled

    def put(self, tensor_list: list[torch.Tensor], func: Any) -> None:
        assert self.enabled is True, "delay_wgrad_compute is not enabled"
        assert self.context is not None
        self.context.put([tensor_list, func])

    def pop(self) -> tuple[Any, list[torch.Tensor]]:
        # pop() runs the oldest entry's function on its tensors and returns (result, tensors)
        assert self.enabled is True, "delay_wgrad_compute is not enabled"
        assert self.context is not None
        if self.context.qsize() > 0:
            tensor_list, func = self.context.get()
            return func(*tensor_list), tensor_list
        raise RuntimeError("Pop empty queue.")


class TransformerEngineBaseModule(torch.nn.Module):
    """module/base.py TransformerEngineBaseModule: the delayed-wgrad interface."""

    weight_names: ClassVar[list[str]] = ["weight"]
    bias_names: ClassVar[list[str]] = ["bias"]

    def __init__(self) -> None:
        super().__init__()
        self.wgrad_store: WeightGradStore | None = None  # set by the layer's __init__
        self.wgrad_accumulation_and_reduce_hooks: list[Any] = []
        self.fuse_wgrad_accumulation = False
        self.use_bias = False

    def register_wgrad_accumulation_and_reduce_hooks(self, hook: Any) -> None:
        # base.py: megatron DDP (ddp_config.delay_wgrad_compute) registers its grad-ready hooks here
        self.wgrad_accumulation_and_reduce_hooks.append(hook)

    def need_backward_dw(self) -> bool:
        # base.py need_backward_dw(): the store exists and defers
        return self.wgrad_store is not None and self.wgrad_store.delay_wgrad_compute()

    def backward_dw(self) -> None:
        # base.py backward_dw(): pop one entry; weight.grad is ASSIGNED unless fused accumulation wrote
        # main_grad; bias.grad set only when it is None; then the registered hooks run.
        if not self.need_backward_dw():
            return
        assert self.wgrad_store is not None
        (wgrad, bgrad), _ = self.wgrad_store.pop()
        if not self.fuse_wgrad_accumulation:
            weight = getattr(self, self.weight_names[0])
            weight.grad = wgrad.to(weight.dtype)
        if self.use_bias:
            bias = getattr(self, self.bias_names[0])
            if bias.grad is None:
                bias.grad = bgrad.to(bias.dtype)
        del wgrad, bgrad
        self._trigger_wgrad_accumulation_and_reduce_hooks()

    def _trigger_wgrad_accumulation_and_reduce_hooks(self) -> None:
        for hook in self.wgrad_accumulation_and_reduce_hooks:
            hook()


def _wgrad_gemm_for(weight: torch.nn.Parameter, use_bias: bool, fuse: bool) -> Any:
    """module/linear.py _linear_backward's ``wgrad_gemm`` closure: dw = dy^T x (and db = sum dy).

    Under ``fuse_wgrad_accumulation`` the GEMM's output is ``main_grad`` with ``accumulate=True``
    (``wgrad_gemm_kwargs["out"]``; ``is_first_microbatch`` is None, as megatron passes it with
    ``disable_parameter_transpose_cache``); ``main_grad`` is read when the backward runs (B).
    """
    main_grad = weight.main_grad if fuse else None

    @torch.no_grad()  # TE's general_gemm is a plain kernel call, outside autograd
    def wgrad_gemm(x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        dw = dy2.t().matmul(x2)
        if main_grad is not None:
            main_grad.add_(dw)
            dw = main_grad
        return dw, (dy2.sum(dim=0) if use_bias else None)

    return wgrad_gemm


def _finish_wgrad(weight: torch.nn.Parameter, fuse: bool, wgrad: torch.Tensor | None) -> torch.Tensor | None:
    """module/linear.py _linear_backward, end: what B hands autograd for the weight.

    Fused accumulation with megatron's ``grad_added_to_main_grad`` attribute: a dummy gradient (zeros with
    ``zero_out_wgrad``) and the attribute set, so that megatron's DDP hook does not add it; fused without
    it: None; otherwise the computed gradient (None when deferred).
    """
    if fuse and hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
        return get_dummy_wgrad(list(weight.shape), weight.dtype, zero=getattr(weight, "zero_out_wgrad", False))
    if fuse:
        return None
    return wgrad


class _LinearFn(torch.autograd.Function):
    """module/linear.py _Linear: forward GEMM; backward dgrad now, wgrad now or into the module's store."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, module: Linear) -> Any:
        ctx.save_for_backward(x, weight)
        ctx.module = module
        ctx.wgrad_store = module.wgrad_store if module.wgrad_store.delay_wgrad_compute() else None  # forward()
        out = x.matmul(weight.t())
        if module.parallel_mode == "row" and module.tp_size > 1:
            dist.all_reduce(out, group=module.tp_group)
        if bias is not None:
            out = out + bias
        return out

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        x, weight = ctx.saved_tensors
        module: Linear = ctx.module
        weight_param = module.weight  # "origin_weight_python_object"
        dgrad = dy.matmul(weight)
        if module.parallel_mode == "column" and module.tp_size > 1:
            dist.all_reduce(dgrad, group=module.tp_group)
        wgrad_gemm = _wgrad_gemm_for(weight_param, module.use_bias, module.fuse_wgrad_accumulation)
        wgrad = grad_bias = None
        if ctx.wgrad_store is not None and ctx.wgrad_store.delay_wgrad_compute():
            ctx.wgrad_store.put([x, dy], wgrad_gemm)  # linear.py: wgrad_store.put([inputmat_total, grad_output], ...)
        else:
            wgrad, grad_bias = wgrad_gemm(x, dy)
        wgrad = _finish_wgrad(weight_param, module.fuse_wgrad_accumulation, wgrad)
        return dgrad, wgrad, (grad_bias if module.use_bias else None), None


class Linear(TransformerEngineBaseModule):
    """module/linear.py Linear, reduced to plain / column- / row-parallel GEMMs."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        tp_group: Any = None,
        tp_size: int = 1,
        parallel_mode: str | None = None,
        fuse_wgrad_accumulation: bool = False,
        delay_wgrad_compute: bool = False,
        init: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.tp_group, self.tp_size, self.parallel_mode = tp_group, tp_size, parallel_mode
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.use_bias = bias
        rank = dist.get_rank(tp_group) if tp_size > 1 else 0
        full = init if init is not None else torch.randn(out_features, in_features)
        if parallel_mode == "column":
            shard = full.chunk(tp_size, dim=0)[rank]
        elif parallel_mode == "row":
            shard = full.chunk(tp_size, dim=1)[rank]
        else:
            shard = full
        self.weight = torch.nn.Parameter(shard.clone())
        rows = shard.shape[0] if parallel_mode == "column" else out_features
        self.bias = torch.nn.Parameter(torch.linspace(-0.1, 0.1, rows)) if bias else None
        self.wgrad_store = WeightGradStore(delay_wgrad_compute)  # linear.py __init__
        if self.wgrad_store.delay_wgrad_compute():  # linear.py __init__: DDP must hook these on the module
            for name, param in self.named_parameters():
                if name in self.weight_names or name in self.bias_names:
                    param.skip_backward_post_hook = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LinearFn.apply(x, self.weight, self.bias if self.use_bias else None, self)


class _MLPFn(torch.autograd.Function):
    """module/layernorm_mlp.py _LayerNormMLP (without the norm): fc1, gelu, fc2; B queues fc2 then fc1."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, module: LayerNormMLP) -> Any:
        h = x.matmul(w1.t())
        a = torch.nn.functional.gelu(h)
        ctx.save_for_backward(x, h, a, w1, w2)
        ctx.module = module
        return a.matmul(w2.t())

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> Any:
        x, h, a, w1, w2 = ctx.saved_tensors
        module: LayerNormMLP = ctx.module
        fuse = module.fuse_wgrad_accumulation
        da = dy.matmul(w2)
        with torch.enable_grad():
            hh = h.detach().requires_grad_()
            (dh,) = torch.autograd.grad(torch.nn.functional.gelu(hh), hh, da)
        dx = dh.matmul(w1)
        gemm2 = _wgrad_gemm_for(module.fc2_weight, False, fuse)
        gemm1 = _wgrad_gemm_for(module.fc1_weight, False, fuse)
        store = module.wgrad_store
        if store.delay_wgrad_compute():
            store.put([a, dy], gemm2)  # layernorm_mlp.py: fc2's entry first, then fc1's
            store.put([x, dh], gemm1)
            w1g = w2g = None
        else:
            w2g, _ = gemm2(a, dy)
            w1g, _ = gemm1(x, dh)
        return (
            dx,
            _finish_wgrad(module.fc1_weight, fuse, w1g),
            _finish_wgrad(module.fc2_weight, fuse, w2g),
            None,
        )


class LayerNormMLP(TransformerEngineBaseModule):
    """module/layernorm_mlp.py LayerNormMLP: its own backward_dw pops two entries (fc2, then fc1)."""

    weight_names: ClassVar[list[str]] = ["fc1_weight", "fc2_weight"]
    bias_names: ClassVar[list[str]] = []

    def __init__(
        self, hidden: int, ffn: int, *, fuse_wgrad_accumulation: bool = False, delay_wgrad_compute: bool = False
    ) -> None:
        super().__init__()
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        gen = torch.Generator().manual_seed(hidden * 31 + ffn)
        self.fc1_weight = torch.nn.Parameter(torch.randn(ffn, hidden, generator=gen) * 0.3)
        self.fc2_weight = torch.nn.Parameter(torch.randn(hidden, ffn, generator=gen) * 0.3)
        self.wgrad_store = WeightGradStore(delay_wgrad_compute)
        if self.wgrad_store.delay_wgrad_compute():
            for p in (self.fc1_weight, self.fc2_weight):
                p.skip_backward_post_hook = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _MLPFn.apply(x, self.fc1_weight, self.fc2_weight, self)

    def backward_dw(self) -> None:
        # layernorm_mlp.py backward_dw(): two pops, weights assigned unless fused, then the hooks
        if not self.need_backward_dw():
            return
        assert self.wgrad_store is not None
        (fc2_wgrad, _), _ = self.wgrad_store.pop()
        (fc1_wgrad, _), _ = self.wgrad_store.pop()
        if not self.fuse_wgrad_accumulation:
            self.fc2_weight.grad = fc2_wgrad
            self.fc1_weight.grad = fc1_wgrad
        self._trigger_wgrad_accumulation_and_reduce_hooks()


class _GroupedLinearFn(torch.autograd.Function):
    """module/grouped_linear.py _GroupedLinear (the split-quantize path, no FP8): one GEMM per expert.

    forward(): the input's rows are split by ``m_splits`` and expert ``i``'s rows multiply ``weight{i}``.
    backward(): the input gradient now; the weight GEMMs write into ``wgrad_list``, buffers allocated in
    B (``wgrad_packed`` views, or the weights' ``main_grad`` under fused accumulation), either now or, with
    deferral, when ``backward_dw`` pops ``[inputmats, grad_output, wgrad_list]`` from the store.
    """

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, m_splits: list[int], module: GroupedLinear, *weights_and_biases: Any) -> Any:
        n = module.num_gemms
        weights, biases = weights_and_biases[:n], weights_and_biases[n:]
        inputmats = list(torch.split(x.reshape(-1, x.shape[-1]), m_splits))
        outs = [xi.matmul(w.t()) for xi, w in zip(inputmats, weights, strict=True)]
        if module.apply_bias:
            outs = [o + b for o, b in zip(outs, biases, strict=True)]
        ctx.save_for_backward(*inputmats, *weights)
        ctx.module, ctx.m_splits, ctx.inp_shape = module, m_splits, x.shape
        ctx.wgrad_store = module.wgrad_store  # forward(): non_tensor_args carries self.wgrad_store
        ctx.weights_requires_grad = weights[0].requires_grad
        return torch.cat(outs).view(*x.shape[:-1], module.out_features)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> Any:
        module: GroupedLinear = ctx.module
        n = module.num_gemms
        inputmats, weights = list(ctx.saved_tensors[:n]), ctx.saved_tensors[n:]
        origin = module.weights()  # ctx.origin_weight_refs: the parameters, for main_grad and attributes
        fuse = module.fuse_wgrad_accumulation
        grad_outputs = list(torch.split(grad_output.reshape(-1, grad_output.shape[-1]), ctx.m_splits))
        dgrad = torch.cat([dy.matmul(w) for dy, w in zip(grad_outputs, weights, strict=True)])
        wgrad_list: list[Any] = [None] * n
        grad_biases: list[Any] = [None] * n
        if ctx.weights_requires_grad:
            if fuse:
                wgrad_list = [w.main_grad for w in origin]  # main_grads = [main_grad_func() ...]
            else:
                packed = torch.empty(n, *weights[0].shape, dtype=weights[0].dtype)  # wgrad_packed
                wgrad_list = [packed[i] for i in range(n)]
            gemm = _grouped_wgrad_gemm(module.apply_bias, accumulate=fuse)
            store = ctx.wgrad_store
            if store is not None and store.delay_wgrad_compute():
                store.put([inputmats, grad_outputs, wgrad_list], gemm)  # the three lists, as grouped_linear.py
            else:
                _, grad_biases, _ = gemm(inputmats, grad_outputs, wgrad_list)
            wgrad_list = [_finish_wgrad(w, fuse, g) for w, g in zip(origin, wgrad_list, strict=True)]
        if not module.apply_bias or (ctx.wgrad_store is not None and ctx.wgrad_store.delay_wgrad_compute()):
            grad_biases = [None] * n
        return (dgrad.view(ctx.inp_shape), None, None, *wgrad_list, *grad_biases)


def _grouped_wgrad_gemm(use_bias: bool, accumulate: bool) -> Any:
    """grouped_linear.py ``grouped_gemm_wgrad`` (general_grouped_gemm, layout NT): ``out[i] = dy_i^T x_i``,
    added to ``out[i]`` when ``accumulate`` (fused accumulation into ``main_grad``); returns
    ``(out, bias gradients, None)`` as the grouped GEMM does."""

    @torch.no_grad()
    def gemm(inputmats: list[torch.Tensor], grad_outputs: list[torch.Tensor], out: list[torch.Tensor]) -> Any:
        biases = []
        for x, dy, o in zip(inputmats, grad_outputs, out, strict=True):
            dw = dy.t().matmul(x)
            if accumulate:
                o.add_(dw)
            else:
                o.copy_(dw)
            biases.append(dy.sum(dim=0) if use_bias else None)
        return out, biases, None

    return gemm


class GroupedLinear(TransformerEngineBaseModule):
    """module/grouped_linear.py GroupedLinear: ``num_gemms`` experts' linears, parameters ``weight{i}`` /
    ``bias{i}``; tensor-parallel size 1 only (megatron passes ``parallel_mode=None`` and ``tp_size=1``
    whenever experts are split over ranks, its token dispatcher moving the tokens)."""

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        sequence_parallel: bool = False,
        fuse_wgrad_accumulation: bool = False,
        tp_group: Any = None,
        tp_size: int = 1,
        get_rng_state_tracker: Any = None,
        rng_tracker_name: str | None = None,
        init_method: Any = None,
        bias: bool = True,
        return_bias: bool = False,
        params_dtype: torch.dtype | None = None,
        parallel_mode: str | None = None,
        device: Any = "cpu",
        ub_name: str | None = None,
        delay_wgrad_compute: bool = False,
        save_original_input: bool = False,
        name: str | None = None,
    ) -> None:
        super().__init__()
        assert tp_size == 1, (
            "the stand-in's grouped linear has no tensor parallelism (megatron passes TP 1 to TE whenever "
            "experts are split over ranks: its dispatcher moves the tokens)"
        )
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.fuse_wgrad_accumulation = fuse_wgrad_accumulation
        self.use_bias, self.return_bias = bias, return_bias
        self.apply_bias = bias and not return_bias
        self.sequence_parallel, self.tp_size = sequence_parallel, tp_size
        self.wgrad_store = WeightGradStore(delay_wgrad_compute)  # grouped_linear.py __init__
        dtype = params_dtype or torch.get_default_dtype()
        for i in range(num_gemms):
            weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
            if init_method is not None:
                with torch.no_grad():
                    init_method(weight)
            else:
                torch.nn.init.normal_(weight, std=0.02)
            self.register_parameter(f"weight{i}", weight)
            if bias:
                self.register_parameter(f"bias{i}", torch.nn.Parameter(torch.zeros(out_features, dtype=dtype)))
            else:
                setattr(self, f"bias{i}", torch.Tensor().to(dtype=dtype))
        if self.wgrad_store.delay_wgrad_compute():  # __init__, end: DDP hooks these on the module
            for pname, param in self.named_parameters():
                if any(pname in (f"weight{i}", f"bias{i}") for i in range(num_gemms)):
                    param.skip_backward_post_hook = True

    def weights(self) -> list[torch.nn.Parameter]:
        """_get_weight_tensors()"""
        return [getattr(self, f"weight{i}") for i in range(self.num_gemms)]

    def forward(self, inp: torch.Tensor, m_splits: Any, is_first_microbatch: bool | None = None) -> Any:
        splits = [int(s) for s in (m_splits.tolist() if isinstance(m_splits, torch.Tensor) else m_splits)]
        if len(splits) != self.num_gemms:
            raise ValueError(f"{len(splits)} splits for {self.num_gemms} GEMMs")
        biases = [getattr(self, f"bias{i}") for i in range(self.num_gemms)]
        if torch.is_grad_enabled():
            out = _GroupedLinearFn.apply(inp, splits, self, *self.weights(), *biases)
        else:
            out = _GroupedLinearFn.forward(None, inp, splits, self, *self.weights(), *biases)
        if self.return_bias:
            return out, biases
        return out

    def backward_dw(self) -> None:
        # grouped_linear.py backward_dw(): nothing on an empty queue; else pop one entry, weights ASSIGNED
        # from the entry's wgrad_list unless fused, bias.grad set only when None, then the hooks.
        if not self.need_backward_dw():
            return
        assert self.wgrad_store is not None
        if self.wgrad_store.context is None or self.wgrad_store.context.empty():
            return
        (_, grad_biases, _), tensor_list = self.wgrad_store.pop()
        wgrad_output = tensor_list[2]
        if not self.fuse_wgrad_accumulation:
            for w, g in zip(self.weights(), wgrad_output, strict=True):
                w.grad = g.to(w.dtype)
        if self.use_bias and any(b is not None and b.numel() for b in grad_biases):
            for i, b in enumerate(grad_biases):
                param = getattr(self, f"bias{i}")
                if b is not None and param.grad is None:
                    param.grad = b.to(param.dtype)
        del grad_biases, wgrad_output, tensor_list
        self._trigger_wgrad_accumulation_and_reduce_hooks()


class MegatronTELinear(Linear):
    """megatron-core 0.19.2 extensions/transformer_engine.py TELinear: ``backward_dw`` gated on its config."""

    def __init__(self, *args: Any, config: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.config = config

    def backward_dw(self) -> None:
        if self.config.delay_wgrad_compute:
            super().backward_dw()


# The adapter recognises megatron's wrappers by their defining module, as it would the real ones.
MegatronTELinear.__module__ = "megatron.core.extensions.transformer_engine"
STANDIN_LAYER_CLASSES: list[type] = [Linear, LayerNormMLP, GroupedLinear]
