"""The executor on its own (:mod:`megatron_pp_ext.runtime.executor`), on a fake chunk in one process.

One pipeline rank (a gloo group of one, started once for the module), a two-layer chunk of plain torch
linears shaped as megatron expects a chunk (``config``, ``set_input_tensor``), and schedules written as data:
the executor's contract with megatron (losses per micro-batch, gradients equal to plain autograd's), the B/W
split (B leaves the weight gradients to W, W computes them, in any order a schedule gives), an overlap pair
handed to the chunk's hook exactly once with its two ops, and refusals of a wrong chunk count or micro-batch
count. No megatron model and no second rank: what a full verify run would hide behind both.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from megatron_pp_ext.schedules.ir import Op, OpKind
from megatron_pp_ext.schedules.placement import make_placement
from megatron_pp_ext.schedules.schedule import Schedule
from tests.tiers import launches_ranks

HIDDEN, SEQ, MBS, M = 8, 4, 2, 4


@pytest.fixture(scope="module")
@launches_ranks
def one_rank_group() -> Iterator[Any]:
    """A gloo process group of one rank and megatron's process-group collection over it."""
    import torch.distributed as dist

    from megatron_pp_ext.integration.cpu import enable_cpu_mode

    enable_cpu_mode()
    from megatron.core.process_groups_config import ProcessGroupCollection

    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            group = dist.new_group([0], backend="gloo")
            collection = ProcessGroupCollection(pp=group, tp=group, cp=group, dp=group, embd=None, pos_embd=None)
            yield collection
        finally:
            dist.destroy_process_group()


class FakeChunk(torch.nn.Module):
    """Two linears with a tanh between, through megatron's linear function (the one whose backward the B/W split
    defers, :mod:`megatron_pp_ext.runtime.wgrad_hooks`), on a tensor-parallel group of one rank."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        from megatron.core.transformer.transformer_config import TransformerConfig

        generator = torch.Generator().manual_seed(seed)
        self.config = TransformerConfig(
            num_layers=1, hidden_size=HIDDEN, num_attention_heads=1, pipeline_dtype=torch.float32
        )
        shapes = {"weight1": (HIDDEN, HIDDEN), "bias1": (HIDDEN,), "weight2": (HIDDEN, HIDDEN), "bias2": (HIDDEN,)}
        for name, shape in shapes.items():
            self.register_parameter(name, torch.nn.Parameter(torch.randn(shape, generator=generator) * 0.3))
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, tensor: Any) -> None:
        self.input_tensor = tensor[0] if isinstance(tensor, list) else tensor

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist
        from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce as linear

        group = dist.group.WORLD
        hidden = torch.tanh(linear(batch, self.weight1, self.bias1, False, False, False, tp_group=group))
        return linear(hidden, self.weight2, self.bias2, False, False, False, tp_group=group)


def batches(seed: int = 1) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(SEQ, MBS, HIDDEN, generator=generator) for _ in range(M)]


def forward_step(data_iterator: Any, model: FakeChunk) -> tuple[torch.Tensor, Any]:
    output = model(next(data_iterator))

    def loss_func(output_tensor: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        loss = output_tensor.pow(2).mean()
        return loss, {"loss": loss.detach().clone()}  # megatron divides the loss in place

    return output, loss_func


def reference_grads(chunk_seed: int = 0) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain autograd: the mean of the micro-batches' losses, each backward on its own."""
    model = FakeChunk(chunk_seed)
    losses = []
    for batch in batches():  # megatron's linear function with its fused backward: plain autograd
        loss = model(batch).pow(2).mean()
        (loss / M).backward()
        losses.append(float(loss))
    return losses, {name: p.grad.clone() for name, p in model.named_parameters()}


def run(schedule: Schedule, collection: Any, model: FakeChunk | None = None) -> tuple[list[Any], FakeChunk]:
    from megatron_pp_ext.runtime.executor import make_forward_backward_func

    model = model or FakeChunk()
    func = make_forward_backward_func(lambda m: schedule)
    losses = func(
        forward_step_func=forward_step,
        data_iterator=iter(batches()),
        model=[model],
        num_microbatches=M,
        seq_length=SEQ,
        micro_batch_size=MBS,
        pg_collection=collection,
    )
    return losses, model


def one_rank(order: str, pairs: tuple[int, ...] = ()) -> Schedule:
    """A one-rank schedule from ``"F.0 BW.0 ..."`` (kind, micro-batch), with overlap pairs at those indices."""
    ops = tuple(Op(OpKind(text.split(".")[0]), 0, int(text.split(".")[1])) for text in order.split())
    schedule = Schedule(make_placement("loop", 1, 1), M, (ops,), name="test")
    return schedule.with_overlap_pairs([pairs]) if pairs else schedule


def assert_matches_reference(losses: list[Any], model: FakeChunk) -> None:
    expected_losses, expected_grads = reference_grads()
    assert [float(entry["loss"]) for entry in losses] == pytest.approx(expected_losses, rel=1e-6)
    for name, parameter in model.named_parameters():
        assert parameter.grad is not None, name
        torch.testing.assert_close(parameter.grad, expected_grads[name], rtol=1e-6, atol=1e-7)


def test_fused_backward_matches_autograd(one_rank_group: Any) -> None:
    losses, model = run(one_rank("F.0 BW.0 F.1 BW.1 F.2 BW.2 F.3 BW.3"), one_rank_group)
    assert_matches_reference(losses, model)


@pytest.fixture
def split_hooks() -> Iterator[None]:
    """The B/W split's hooks on megatron's linear function, as ``install()`` puts them for a split schedule."""
    from megatron_pp_ext.runtime.wgrad_hooks import install_wgrad_hooks, uninstall_wgrad_hooks

    install_wgrad_hooks()
    try:
        yield
    finally:
        uninstall_wgrad_hooks()


@pytest.mark.usefixtures("split_hooks")
def test_split_backward_in_any_w_order_matches_autograd(one_rank_group: Any) -> None:
    """B defers every linear's weight gradient; W runs them, here in an order unlike B's."""
    order = "F.0 F.1 B.1 B.0 F.2 W.0 B.2 F.3 B.3 W.3 W.1 W.2"
    losses, model = run(one_rank(order), one_rank_group)
    assert_matches_reference(losses, model)


@pytest.mark.usefixtures("split_hooks")
def test_b_leaves_weight_gradients_to_w(one_rank_group: Any) -> None:
    """At the first W every B has run: no weight or bias gradient of the linears yet; W computes them all."""
    from megatron_pp_ext.runtime.wgrad import get_weight_grad_store

    order = "F.0 B.0 F.1 B.1 F.2 B.2 F.3 B.3 W.0 W.1 W.2 W.3"
    seen: list[bool] = []
    store = get_weight_grad_store()
    original_run = store.run

    def run_w(*args: Any, **kwargs: Any) -> Any:
        if not seen:  # the first W: every B has run
            seen.append(all(p.grad is None or not p.grad.any() for p in model.parameters()))
        return original_run(*args, **kwargs)

    model = FakeChunk()
    store.run = run_w  # type: ignore[method-assign]
    try:
        losses, _ = run(one_rank(order), one_rank_group, model)
    finally:
        store.run = original_run  # type: ignore[method-assign]
    assert seen == [True]
    assert_matches_reference(losses, model)


def test_overlap_pair_goes_to_the_hook_once(one_rank_group: Any) -> None:
    """An overlap pair (F of one micro-batch, B of another) reaches the chunk's hook with both ops."""
    calls: list[tuple[str, str]] = []

    def hook(forward: Any, backward: Any) -> None:
        calls.append((str(forward.op), str(backward.op)))
        backward.run()  # any order the hook likes: here the backward first
        forward.run()

    model = FakeChunk()
    model.overlapped_forward_backward = hook  # type: ignore[assignment]
    order = "F.0 F.1 BW.0 F.2 BW.1 F.3 BW.2 BW.3"
    schedule = one_rank(order, pairs=(1, 3))  # F.1+BW.0 and F.2+BW.1
    losses, model = run(schedule, one_rank_group, model)
    assert calls == [("F0.1", "BW0.0"), ("F0.2", "BW0.1")]
    assert_matches_reference(losses, model)


def test_wrong_chunk_count_is_refused(one_rank_group: Any) -> None:
    from megatron_pp_ext.runtime.errors import ExecutorError

    with pytest.raises(ExecutorError, match=r"places 1 model chunk\(s\) on this rank .* got 2"):
        from megatron_pp_ext.runtime.executor import make_forward_backward_func

        make_forward_backward_func(lambda m: one_rank("F.0 BW.0 F.1 BW.1 F.2 BW.2 F.3 BW.3"))(
            forward_step_func=forward_step,
            data_iterator=iter(batches()),
            model=[FakeChunk(), FakeChunk()],
            num_microbatches=M,
            seq_length=SEQ,
            micro_batch_size=MBS,
            pg_collection=one_rank_group,
        )


def test_wrong_microbatch_count_is_refused(one_rank_group: Any) -> None:
    from megatron_pp_ext.runtime.errors import ExecutorError
    from megatron_pp_ext.runtime.executor import make_forward_backward_func

    func = make_forward_backward_func(lambda m: one_rank("F.0 BW.0 F.1 BW.1 F.2 BW.2 F.3 BW.3"))
    with pytest.raises(ExecutorError, match="is for 4 micro-batches, megatron asked for 3"):
        func(
            forward_step_func=forward_step,
            data_iterator=iter(batches()),
            model=[FakeChunk()],
            num_microbatches=3,
            seq_length=SEQ,
            micro_batch_size=MBS,
            pg_collection=one_rank_group,
        )
