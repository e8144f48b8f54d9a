"""torch.distributed.pipelining's runtime on the same megatron tiny GPT chunks as our executor (peer benchmark).

Each rank builds its megatron-core ``GPTModel`` chunks exactly as :func:`tiny_gpt.build_chunks` does for
our runs (same weights, same data) and wraps each in a small module that torch's ``PipelineStage`` can
drive: the first stage takes token ids, later stages the hidden states ``[s, b, h]`` (through megatron's
``set_input_tensor``), the last returns the logits and torch's ``loss_fn`` takes their mean token
cross-entropy (megatron's loss with an all-ones mask). Every iteration then runs torch's schedule and
ours on the same chunks, alternating which goes first; both are timed, both losses are kept, and one
more iteration of each runs under :class:`~megatron_pp_ext.verification.saved_bytes.SavedBytesMeter`.

No data parallelism, no megatron DDP (plain ``.grad`` on both sides), no optimizer step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ..verification.rank_setup import rank_process_group
from ..verification.tiny_gpt import TinyGPTSpec

TORCH_CLASSES = {"1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B"}


@dataclass(frozen=True)
class TorchRunSpec:
    schedule: str  # our registry name: 1f1b or interleaved-1f1b
    pp: int
    num_microbatches: int
    chunks: int
    model: TinyGPTSpec
    iterations: int = 6
    timeout_s: float = 300.0


def run_on_rank(spec: TorchRunSpec, rank: int, init_method: str) -> dict[str, Any]:
    with rank_process_group(rank, spec.pp, init_method, timeout_s=spec.timeout_s, pp=spec.pp):
        return _run(spec, rank)


def _run(spec: TorchRunSpec, rank: int) -> dict[str, Any]:
    from torch.distributed.pipelining import schedules as torch_schedules

    from ..runtime.executor import make_forward_backward_func
    from ..schedules import generate
    from ..verification import tiny_gpt
    from ..verification.saved_bytes import SavedBytesMeter

    ours_schedule = generate(spec.schedule, spec.pp, spec.num_microbatches, v=spec.chunks if spec.chunks > 1 else None)
    placement = ours_schedule.placement
    config = tiny_gpt.make_config(spec.model)
    chunks, layouts = tiny_gpt.build_chunks(config, spec.model, placement, rank)
    stages = torch_stages(spec.model, chunks, layouts, placement)
    loss_fn = cross_entropy_loss(spec.model.vocab_size)

    cls = getattr(torch_schedules, TORCH_CLASSES[spec.schedule])
    theirs = cls(stages if spec.chunks > 1 else stages[0], spec.num_microbatches, loss_fn=loss_fn)
    has_first = any(layout.pre_process for layout in layouts)
    has_last = any(layout.post_process for layout in layouts)
    ours = make_forward_backward_func(lambda m: ours_schedule, timeout_s=spec.timeout_s)

    def run_theirs(iteration: int) -> list[float]:
        return torch_step(theirs, spec.model, iteration, spec.num_microbatches, has_first, has_last)

    def run_ours(iteration: int) -> list[float]:
        batches = tiny_gpt.make_batches(spec.model, iteration, spec.num_microbatches)
        return tiny_gpt.run_forward_backward(ours, spec.model, chunks, batches, chunk_list=True)

    runners = {"torch": run_theirs, "ours": run_ours}
    times: dict[str, list[float]] = {"torch": [], "ours": []}
    losses: dict[str, list[list[float]]] = {"torch": [], "ours": []}
    for iteration in range(spec.iterations):
        order = ["torch", "ours"] if iteration % 2 == 0 else ["ours", "torch"]
        for name in order:
            for c in chunks:
                c.zero_grad(set_to_none=True)
            started = time.perf_counter()
            losses[name].append(runners[name](iteration))
            times[name].append(time.perf_counter() - started)
    params = {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()}
    peak: dict[str, int] = {}
    for name, runner in runners.items():
        for c in chunks:
            c.zero_grad(set_to_none=True)
        meter = SavedBytesMeter(params)
        with meter:
            runner(spec.iterations)
        peak[name] = meter.peak
    return {"rank": rank, "step_times": times, "losses": losses, "peak_saved_bytes": peak}


def torch_stages(model: TinyGPTSpec, chunks: list[Any], layouts: list[Any], placement: Any) -> list[Any]:
    """One torch ``PipelineStage`` per chunk of this rank: token ids into the first stage, hidden states
    ``[s, b, h]`` through megatron's ``set_input_tensor`` into later ones, logits out of the last."""
    import torch
    from torch.distributed.pipelining import PipelineStage

    s, b, h, vocab = model.seq_length, model.micro_batch_size, model.hidden_size, model.vocab_size

    class Stage(torch.nn.Module):
        def __init__(self, gpt: Any, pre: bool) -> None:
            super().__init__()
            self.gpt, self.pre = gpt, pre

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.pre:
                positions = torch.arange(s).unsqueeze(0).expand_as(x).contiguous()
                return self.gpt(x, positions, None)
            self.gpt.set_input_tensor(x)
            return self.gpt(None, None, None)

    stages = []
    for chunk, layout in zip(chunks, layouts, strict=True):
        inp = torch.zeros(b, s, dtype=torch.long) if layout.pre_process else torch.zeros(s, b, h, requires_grad=True)
        out = (torch.zeros(b, s, vocab) if layout.post_process else torch.zeros(s, b, h)).requires_grad_(True)
        module = Stage(chunk, layout.pre_process)
        stages.append(
            PipelineStage(
                module, layout.stage, placement.num_stages, torch.device("cpu"), input_args=inp, output_args=out
            )
        )
    return stages


def cross_entropy_loss(vocab: int) -> Any:
    """torch's ``loss_fn`` for the last stage: the mean token cross-entropy of the ``[b, s, vocab]`` logits,
    computed as our runs compute it (megatron's vocab-parallel cross-entropy on ``[s, b, vocab]``, then the
    mean over the tokens, all of which the verification data's mask keeps), so both runtimes pay the same
    loss and get the same numbers."""
    from megatron.core import tensor_parallel

    def loss_fn(logits: Any, target: Any) -> Any:
        if logits.shape[-1] != vocab:
            raise ValueError(f"logits end in {logits.shape[-1]} classes, the model's vocabulary is {vocab}")
        losses = tensor_parallel.vocab_parallel_cross_entropy(
            logits.transpose(0, 1).contiguous(), target.transpose(0, 1).contiguous()
        )
        losses = losses.transpose(0, 1).contiguous().view(-1).float()  # [b, s] as megatron's model returns it
        return losses.sum() / losses.numel()

    return loss_fn


def torch_step(
    schedule: Any, model: TinyGPTSpec, iteration: int, num_microbatches: int, has_first: bool, has_last: bool
) -> list[float]:
    """One ``step`` of a torch pipelining schedule on iteration ``iteration``'s micro-batches (the ones our runs
    get); the losses this rank computed (empty unless it holds the last stage)."""
    import torch

    from ..verification import tiny_gpt

    batches = tiny_gpt.make_batches(model, iteration, num_microbatches)
    tokens = torch.cat([x["tokens"] for x in batches])
    labels = torch.cat([x["labels"] for x in batches])
    losses: list[torch.Tensor] = []
    args = (tokens,) if has_first else ()
    schedule.step(*args, target=labels if has_last else None, losses=losses if has_last else None)
    return [float(x) for x in losses]
