"""Split megatron-core's linear backward into B (input gradient) and W (weight gradient).

megatron-core's ``ColumnParallelLinear``, ``RowParallelLinear`` and the GPT output
layer all run ``LinearWithGradAccumulationAndAsyncCommunication``. While the
executor runs a ``B`` op (:meth:`WeightGradStore.deferring`), our subclass of that
autograd function computes the input gradient as megatron does — including the
tensor-parallel all-reduce or, with sequence parallelism, the reduce-scatter,
which both complete inside B — and returns no weight/bias gradient. It queues a
closure instead; the ``W`` op of the same (chunk, micro-batch) runs it:

* the weight gradient ``grad_output^T @ input`` (and ``grad_output.sum(0)`` for
  the bias), exactly the GEMMs megatron's unsplit backward runs;
* accumulation through the parameter's own autograd accumulator (:func:`hand_over`: the gradients
  reach it from an autograd function's backward, as in a fused backward), so megatron DDP's grad hooks
  (``main_grad`` accumulation, ``overlap_grad_reduce`` bucket readiness) fire as
  they would in a fused backward; with ``gradient_accumulation_fusion`` the GEMM
  accumulates straight into ``main_grad`` through megatron's fused kernel and the
  hook sees ``grad_added_to_main_grad``, as in megatron.

Sequence parallelism: W needs the all-gathered input again. We keep only the
local shard between B and W and all-gather it again in W (one extra all-gather of
the layer input per linear per micro-batch) rather than keeping the gathered
tensor (``tp`` times the memory) — deferral exists to fill bubbles without
growing memory, so memory wins; ``benchmarks/RESULTS.md`` lists the extra volume.

MoE: megatron's ``SequentialMLP`` experts are ``ColumnParallelLinear`` /
``RowParallelLinear`` modules, so their weights defer through the same function.
The router's gate (``TopKRouter.weight``, and its bias if any) runs megatron's
``RouterGatingLinearFunction``; :func:`install_wgrad_hooks` replaces it with a
subclass that, during a B, computes the input gradient and queues the gate's
weight gradient with the same GEMM (torch's or Transformer Engine's, as
megatron's backward picks) for the W.

Weight gradients that stay in B (computed by autograd as usual): LayerNorm /
RMSNorm weights and biases, word and position embeddings, ``RowParallelLinear``'s
bias (megatron adds it after the reduction, outside the linear's autograd
function; so also the experts' second bias), and any parameter owned by neither a
megatron linear nor the router's gate.
``tests/selfcheck/test_wgrad_split.py`` checks per layer kind which gradients B
leaves untouched and that each W computes all the others.
"""

from __future__ import annotations

from typing import Any

import torch

from .wgrad import get_weight_grad_store

_ORIGINAL: Any = None
_SPLIT: Any = None
_ORIGINAL_ROUTER: Any = None
_SPLIT_ROUTER: Any = None


class _HandOver(torch.autograd.Function):
    """A node between parameters and nothing: its backward computes their gradients (``ctx.compute``)."""

    @staticmethod
    def forward(ctx: Any, compute: Any, *params: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.compute = compute
        return params[0].new_zeros(())

    @staticmethod
    def backward(ctx: Any, _: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        grads = ctx.compute()
        ctx.compute = None
        return (None, *grads)


def hand_over(params: list[torch.Tensor], compute: Any) -> None:
    """Accumulate ``compute()`` (one gradient per parameter, computed now) into ``params`` through their
    autograd accumulators, so every grad hook (megatron DDP's ``main_grad`` accumulation) fires.

    The gradients are returned from an autograd function's backward, as a fused backward returns its weight
    gradient: the engine holds the only reference, and the accumulator takes the tensor as the parameter's
    ``.grad`` without copying it. ``torch.autograd.backward(params, grads)`` would copy every one of them
    first (its caller still holds ``grads``): a weight-sized copy per linear per micro-batch in every W.
    """
    torch.autograd.backward(_HandOver.apply(compute, *params))


def _weight_grad_closure(ctx: Any, input_: torch.Tensor, weight: torch.Tensor, grad_output: torch.Tensor) -> Any:
    from megatron.core.tensor_parallel import layers as mlayers
    from megatron.core.utils import prepare_input_tensors_for_wgrad_compute

    sequence_parallel = ctx.sequence_parallel
    tp_group = ctx.tp_group
    fusion = ctx.gradient_accumulation_fusion
    main_grad = ctx.main_grad
    bias = ctx.bias_param if ctx.use_bias else None

    def run() -> None:
        if sequence_parallel:
            dim_size = list(input_.size())
            dim_size[0] = dim_size[0] * tp_group.size()
            total_input = torch.empty(dim_size, dtype=input_.dtype, device=input_.device)
            mlayers.dist_all_gather_func(total_input, input_, group=tp_group)
        else:
            total_input = input_
        go, ti = prepare_input_tensors_for_wgrad_compute(grad_output, total_input)
        roots: list[torch.Tensor] = []
        grads: list[Any] = []  # each a function: the gradient is computed inside hand_over's backward
        if fusion:
            weight.main_grad = main_grad
            if main_grad.dtype == torch.float32:
                mlayers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(ti, go, main_grad)
            else:
                mlayers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16(ti, go, main_grad)
            if hasattr(weight, "grad_added_to_main_grad"):
                weight.grad_added_to_main_grad = True
                make = torch.zeros_like if getattr(weight, "zero_out_wgrad", False) else torch.empty_like
                roots.append(weight)
                grads.append(lambda: make(main_grad, dtype=input_.dtype))
        else:
            _clear_dummy_flag(weight)
            roots.append(weight)
            grads.append(lambda: go.t().matmul(ti))
        if bias is not None:
            _clear_dummy_flag(bias)
            roots.append(bias)
            grads.append(lambda: go.sum(dim=0))
        if roots:
            hand_over(roots, lambda: [grad() for grad in grads])

    held = input_.untyped_storage().nbytes() + grad_output.untyped_storage().nbytes()
    return run, held


def _make_split_function(base: Any) -> Any:
    class SplitLinearWithGradAccumulation(base):  # type: ignore[misc, valid-type]
        """megatron's linear autograd function with the weight gradient deferrable to a W op."""

        @staticmethod
        def forward(ctx: Any, input_: Any, weight: Any, bias: Any, *args: Any) -> Any:  # type: ignore[override]
            ctx.bias_param = bias
            # The parameter object itself: what ctx.saved_tensors gives back can be a plain-tensor alias
            # without the parameter's Python attributes (main_grad, grad_added_to_main_grad) when a
            # saved-tensors hook is active (the tracer's), so flags are set on this one.
            ctx.weight_param = weight
            return base.forward(ctx, input_, weight, bias, *args)

        @staticmethod
        def backward(ctx: Any, grad_output: torch.Tensor) -> Any:  # type: ignore[override]
            store = get_weight_grad_store()
            splittable = (
                store.deferring_now and ctx.grad_output_buffer is None and getattr(ctx, "gtp_remat_size", 1) <= 1
            )
            if not splittable:
                return base.backward(ctx, grad_output)
            return _input_grad_only(ctx, grad_output, store)

    SplitLinearWithGradAccumulation.__name__ = "SplitLinearWithGradAccumulation"
    return SplitLinearWithGradAccumulation


def _input_grad_only(ctx: Any, grad_output: torch.Tensor, store: Any) -> tuple[Any, ...]:
    from megatron.core.tensor_parallel import layers as mlayers

    input_, weight = ctx.saved_tensors
    tp_group = ctx.tp_group
    grad_input = grad_output.matmul(weight)
    result: Any = grad_input
    if ctx.allreduce_dgrad:
        torch.distributed.all_reduce(grad_input, group=tp_group)
    elif ctx.sequence_parallel:
        result = torch.empty(list(input_.size()), dtype=input_.dtype, device=input_.device, requires_grad=False)
        mlayers.dist_reduce_scatter_func(result, grad_input, group=tp_group)
    weight = ctx.weight_param
    closure, held = _weight_grad_closure(ctx, input_, weight, grad_output)
    store.put(closure, held)
    bias = ctx.bias_param if ctx.use_bias else None
    return (result, _dummy_grad(weight), _dummy_grad(bias)) + (None,) * 7


def _dummy_grad(param: Any) -> torch.Tensor | None:
    """What B hands a parameter's accumulator: nothing, or under megatron DDP (which asserts a grad
    with ``overlap_grad_reduce``) a dummy flagged as already added to ``main_grad``, as megatron's
    own fused-accumulation backward returns. W clears the flag before its real gradient arrives."""
    if param is None or not hasattr(param, "grad_added_to_main_grad"):
        return None
    param.grad_added_to_main_grad = True
    # megatron's DDP hook adds the grad anyway when zero_out_wgrad is set: then it must be zeros
    return torch.zeros_like(param) if getattr(param, "zero_out_wgrad", False) else torch.empty_like(param)


def _clear_dummy_flag(param: Any) -> None:
    if hasattr(param, "grad_added_to_main_grad"):
        param.grad_added_to_main_grad = False


def _make_split_router(base: Any) -> Any:
    class SplitRouterGatingLinear(base):  # type: ignore[misc, valid-type]
        """megatron's router gate with the weight (and bias) gradient deferrable to a W op."""

        @staticmethod
        def forward(ctx: Any, inp: Any, weight: Any, bias: Any, router_dtype: Any) -> Any:  # type: ignore[override]
            ctx.weight_param, ctx.bias_param = weight, bias  # the parameters themselves (see above)
            return base.forward(ctx, inp, weight, bias, router_dtype)

        @staticmethod
        def backward(ctx: Any, grad_output: torch.Tensor) -> Any:  # type: ignore[override]
            store = get_weight_grad_store()
            if not store.deferring_now:
                return base.backward(ctx, grad_output)
            return _router_input_grad_only(ctx, grad_output, store)

    SplitRouterGatingLinear.__name__ = "SplitRouterGatingLinear"
    return SplitRouterGatingLinear


def _router_gemm() -> Any:
    """Transformer Engine's GEMM where megatron's router uses it (``moe_utils.te_general_gemm``), else None."""
    from megatron.core.transformer.moe import moe_utils

    return getattr(moe_utils, "te_general_gemm", None)


def _router_input_grad_only(ctx: Any, grad_output: torch.Tensor, store: Any) -> tuple[Any, ...]:
    """B of the router gate: the input gradient as ``RouterGatingLinearFunction.backward`` computes it;
    the weight and bias gradients, with the same operations, queued for the W."""
    inp, weight, _ = ctx.saved_tensors
    rdtype = ctx.router_dtype
    inp_shape = inp.shape
    inp2 = inp.view(-1, inp_shape[-1])
    go = grad_output.view(-1, grad_output.shape[-1])
    te_gemm = _router_gemm() if rdtype != torch.float64 else None
    if te_gemm is not None:
        grad_input = te_gemm(weight.to(rdtype), go, rdtype, layout="NN", grad=True)[0].to(ctx.input_dtype)
    else:
        grad_input = torch.mm(go, weight.to(rdtype)).to(ctx.input_dtype)
    weight_param, bias_param, weight_dtype = ctx.weight_param, ctx.bias_param, ctx.weight_dtype

    def run() -> None:
        def compute() -> list[torch.Tensor]:
            if te_gemm is not None:
                grad_weight = te_gemm(inp2.to(rdtype), go, rdtype, layout="NT", grad=True)[0].to(weight_dtype)
            else:
                grad_weight = torch.mm(go.t(), inp2.to(rdtype)).to(weight_dtype)
            if bias_param is None:
                return [grad_weight]
            return [grad_weight, go.sum(dim=0).to(weight_dtype)]

        _clear_dummy_flag(weight_param)
        if bias_param is not None:
            _clear_dummy_flag(bias_param)
        hand_over([weight_param] if bias_param is None else [weight_param, bias_param], compute)

    store.put(run, inp.untyped_storage().nbytes() + grad_output.untyped_storage().nbytes())
    return grad_input.view(*inp_shape), _dummy_grad(weight_param), _dummy_grad(bias_param), None


def install_wgrad_hooks() -> None:
    """Route megatron's linear layers and MoE router gates through the splittable autograd functions
    (idempotent)."""
    global _ORIGINAL, _SPLIT, _ORIGINAL_ROUTER, _SPLIT_ROUTER
    from megatron.core.tensor_parallel import layers as mlayers
    from megatron.core.transformer.moe import moe_utils

    if _SPLIT is None:
        _ORIGINAL = mlayers.LinearWithGradAccumulationAndAsyncCommunication
        _SPLIT = _make_split_function(_ORIGINAL)
    if _SPLIT_ROUTER is None:
        _ORIGINAL_ROUTER = moe_utils.RouterGatingLinearFunction
        _SPLIT_ROUTER = _make_split_router(_ORIGINAL_ROUTER)
    mlayers.LinearWithGradAccumulationAndAsyncCommunication = _SPLIT
    moe_utils.RouterGatingLinearFunction = _SPLIT_ROUTER
    get_weight_grad_store().hooks_installed = True


def uninstall_wgrad_hooks() -> None:
    from megatron.core.tensor_parallel import layers as mlayers
    from megatron.core.transformer.moe import moe_utils

    if _ORIGINAL is not None:
        mlayers.LinearWithGradAccumulationAndAsyncCommunication = _ORIGINAL
    if _ORIGINAL_ROUTER is not None:
        moe_utils.RouterGatingLinearFunction = _ORIGINAL_ROUTER
    get_weight_grad_store().hooks_installed = False
