"""W hands its weight gradients to the parameters' accumulators as a fused backward does
(runtime/wgrad_hooks.hand_over): taken as they are, not copied; hooks fire; existing gradients accumulate."""

from __future__ import annotations

import torch

from megatron_pp_ext.runtime.wgrad_hooks import hand_over


def test_gradients_are_taken_not_copied() -> None:
    weight, bias = torch.nn.Parameter(torch.zeros(64, 32)), torch.nn.Parameter(torch.zeros(32))
    made: list[int] = []

    def compute() -> list[torch.Tensor]:
        grads = [torch.full((64, 32), 2.0), torch.ones(32)]
        made.extend(g.data_ptr() for g in grads)
        return grads

    hand_over([weight, bias], compute)
    assert weight.grad is not None and bias.grad is not None
    assert [weight.grad.data_ptr(), bias.grad.data_ptr()] == made  # the computed tensors themselves
    assert torch.equal(weight.grad, torch.full((64, 32), 2.0)) and torch.equal(bias.grad, torch.ones(32))


def test_hooks_fire_and_existing_gradients_accumulate() -> None:
    weight = torch.nn.Parameter(torch.zeros(4, 4))
    weight.grad = torch.ones(4, 4)
    main_grad = torch.zeros(4, 4)
    seen: list[torch.Tensor] = []

    def hook(param: torch.Tensor) -> None:  # as megatron DDP's: add into main_grad, drop .grad
        assert param.grad is not None
        seen.append(param.grad.clone())
        main_grad.add_(param.grad)

    weight.register_post_accumulate_grad_hook(hook)
    hand_over([weight], lambda: [torch.full((4, 4), 3.0)])
    assert len(seen) == 1 and torch.equal(seen[0], torch.full((4, 4), 4.0))
    assert torch.equal(main_grad, torch.full((4, 4), 4.0))
