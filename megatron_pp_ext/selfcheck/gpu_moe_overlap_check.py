"""The GPU check ``moe-overlap``: one overlapped pair of megatron's combined step on CUDA streams (EP = 1).

A two-layer MoE GPT (two experts, top-2, the all-to-all dispatcher; expert parallelism 1, so the
all-to-all is megatron's identity) on one device runs micro-batch 0's forward alone, then the pair
(micro-batch 1's forward with micro-batch 0's backward) and micro-batch 1's backward alone, each through
megatron's ``combined_forward_backward_step`` as the executor runs them (``runtime/combined_step.py``).
Recorded per schedule-plan node: its name, its side (F or B) and its stream (``comm`` when it is
megatron's communication stream, ``comp`` another stream, ``none`` no stream). The check passes when the
token dispatch and combine nodes of both sides ran on the communication stream and every other node on
the compute stream, the pair's nodes interleave the two micro-batches, and losses and gradients equal
those of megatron's plain ``forward_step`` / ``backward_step`` on the same weights and data (relative
1e-5: the combined step runs the same layers, its reductions may group differently).

One shim, for EP = 1 only: megatron frees the input of a dispatch node after its forward (the tokens before
the all-to-all); with one expert-parallel rank its all-to-all hands back that very tensor, so the freed
input would be the dispatched tokens. megatron refuses the combined step without expert parallelism for
such reasons (``overlap_moe_expert_parallel_comm is only supported with expert model parallelism``, and
the plugin's flag check quotes it); the check keeps the dispatch node's input instead
(:func:`_keeping_dispatch_input`), which changes no number and leaves the streams as they are.

The dry run (``--dry-run``, CPU) runs the same code; CPU mode's communication stream is its worker thread
(``integration/cpu_streams.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ..verification.tiny_gpt import TinyGPTSpec, build_full_model, forward_step, make_batches, make_config
from .gpu_split_check import prepare_single_rank, rel_diff

__all__ = ["moe_overlap"]

COMM_NODES = {"moe_dispatch", "moe_combine"}
TOLERANCE = 1e-5


def _recording(events: list[tuple[str, str, str]]) -> Any:
    """Wrap megatron's node ``_forward`` / ``_backward`` to record (name, side, stream); returns the undo."""
    from megatron.core.pipeline_parallel import utils

    node = utils.ScheduleNode
    originals = (node._forward, node._backward)

    def wrap(original: Any, side: str) -> Any:
        def run(self: Any, *values: Any) -> Any:
            stream = self.stream() if callable(self.stream) else self.stream
            comm = stream is not None and stream is utils.get_comm_stream()
            events.append((self.name, side, "comm" if comm else "comp" if stream is not None else "none"))
            return original(self, *values)

        return run

    node._forward, node._backward = wrap(originals[0], "F"), wrap(originals[1], "B")

    def undo() -> None:
        node._forward, node._backward = originals

    return undo


@contextlib.contextmanager
def _keeping_dispatch_input() -> Iterator[None]:
    """megatron's node policy with the dispatch node's input kept (module docstring: EP = 1)."""
    from megatron.core.models.common import utils

    original = utils.should_free_input

    def should_free_input(name: str, *args: Any) -> bool:
        return False if name == "moe_dispatch" else bool(original(name, *args))

    utils.should_free_input = should_free_input
    try:
        yield
    finally:
        utils.should_free_input = original


def _grads(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _plain(model: Any, config: Any, batches: list[dict[str, Any]]) -> tuple[list[float], dict[str, torch.Tensor]]:
    from megatron.core.pipeline_parallel.schedules import backward_step
    from megatron.core.pipeline_parallel.schedules import forward_step as megatron_forward_step

    store: list[Any] = []
    outputs = []
    for k, batch in enumerate(batches):
        out, _ = megatron_forward_step(
            forward_step, iter([batch]), model, len(batches), None, store, config, 1, current_microbatch=k
        )
        outputs.append(out)
    for out in outputs:
        backward_step(None, out, None, config)
    return [float(s["lm loss"]) for s in store], _grads(model)


def _combined(model: Any, config: Any, batches: list[dict[str, Any]]) -> tuple[list[float], dict[str, Any], list]:
    from megatron.core.pipeline_parallel.combined_1f1b import combined_forward_backward_step
    from megatron.core.pipeline_parallel.utils import set_streams

    set_streams()
    store: list[Any] = []
    steps: list[list[tuple[str, str, str]]] = []

    def step(forward: int | None, backward_output: Any) -> Any:
        events: list[tuple[str, str, str]] = []
        undo = _recording(events)
        try:
            out, _, _ = combined_forward_backward_step(
                forward_step,
                iter([batches[forward]]) if forward is not None else None,
                model if forward is not None else None,
                len(batches),
                None,
                store,
                model if backward_output is not None else None,
                None,
                backward_output,
                None,
                config,
                current_microbatch=forward,
            )
        finally:
            undo()
        steps.append(events)
        return out

    first = step(0, None)
    second = step(1, first)  # the pair: micro-batch 1's forward with micro-batch 0's backward
    step(None, second)
    return [float(s["lm loss"]) for s in store], _grads(model), steps


def moe_overlap(device: str, dry_run: bool) -> dict[str, Any]:
    """Run the check (module docstring); ``status`` pass or fail with the recorded nodes in ``details``."""
    prepare_single_rank(device)
    spec = TinyGPTSpec(num_layers=2, num_experts=2, moe_topk=2)
    config = make_config(spec)
    model = build_full_model(config, spec).to(device)
    batches = [{k: v.to(device) for k, v in b.items()} for b in make_batches(spec, 0, 2)]
    plain_losses, plain_grads = _plain(model, config, batches)
    model.zero_grad(set_to_none=True)
    with _keeping_dispatch_input():
        losses, grads, steps = _combined(model, config, batches)
    pair = steps[1]
    problems = []
    wrong_stream = [e for s in steps for e in s if (e[0] in COMM_NODES) != (e[2] == "comm")]
    if wrong_stream:
        problems.append(f"nodes on the wrong stream: {wrong_stream[:4]}")
    if {(n, side) for n, side, _ in pair if n in COMM_NODES} != {(n, s) for n in COMM_NODES for s in "FB"}:
        problems.append("the pair did not run both sides' dispatch and combine")
    sides = "".join(side for _, side, _ in pair)
    if "FB" not in sides or "BF" not in sides:
        problems.append(f"the pair's nodes do not interleave the micro-batches: {sides}")
    loss_diff = max(abs(a - b) for a, b in zip(losses, plain_losses, strict=True))
    grad_diff = max(rel_diff(grads[n], plain_grads[n]) for n in plain_grads) if set(grads) == set(plain_grads) else 1.0
    if loss_diff > TOLERANCE or grad_diff > TOLERANCE:
        problems.append(f"combined vs plain: loss diff {loss_diff:.1e}, max rel grad diff {grad_diff:.1e}")
    details = {"pair_nodes": pair, "steps": steps, "loss_diff": loss_diff, "max_rel_grad_diff": grad_diff}
    if problems:
        return {"status": "fail", "summary": "; ".join(problems), "details": details}
    comm = sum(1 for e in pair if e[2] == "comm")
    return {
        "status": "pass",
        "summary": f"pair F1+B0: {len(pair)} nodes, {comm} on the communication stream (dispatch, combine), "
        f"sides {sides}; vs plain steps loss diff {loss_diff:.1e}, grad {grad_diff:.1e}",
        "details": details,
    }
