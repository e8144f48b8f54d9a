"""Pipeline chunks of plain torch layers with the shape of the tiny GPT's megatron-core chunks.

torch.distributed.pipelining splits a backward generically (``autograd.grad`` to the inputs, then from the saved
intermediate nodes to the weights). That split is free on plain ``nn.Linear`` layers and costly on megatron's
linear layers, custom autograd functions whose one backward computes both gradients: these chunks give torch's
split schedules the model they are built for, with the megatron chunks' shapes (pre-norm attention and MLP blocks,
the embedding on the first stage, the final norm and output layer on the last), so the peer table can say what
torch's runtime does on its own terms. Own seeded weights: their losses are not comparable with megatron's.
"""

from __future__ import annotations

from typing import Any

import torch

from ..verification.tiny_gpt import TinyGPTSpec


class Block(torch.nn.Module):
    """One pre-norm transformer layer of plain torch modules: causal self-attention, then a GELU MLP (4h)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.hidden, self.heads = hidden, heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(hidden), torch.nn.LayerNorm(hidden)
        self.qkv, self.proj = torch.nn.Linear(hidden, 3 * hidden), torch.nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = torch.nn.Linear(hidden, 4 * hidden), torch.nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [s, b, h] -> [s, b, h]
        s, b, h = x.shape
        qkv = self.qkv(self.norm1(x)).view(s, b, 3, self.heads, h // self.heads).permute(2, 1, 3, 0, 4)
        attended = torch.nn.functional.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2], is_causal=True)
        x = x + self.proj(attended.permute(2, 0, 1, 3).reshape(s, b, h))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm2(x))))


class PlainStage(torch.nn.Module):
    """A pipeline stage: token ids ``[b, s]`` (first) or hidden states ``[s, b, h]`` in; hidden states or, on the
    last stage, logits ``[b, s, vocab]`` out (what torch's stages around our megatron chunks exchange)."""

    def __init__(self, model: TinyGPTSpec, num_layers: int, pre: bool, post: bool) -> None:
        super().__init__()
        h = model.hidden_size
        self.pre, self.post = pre, post
        if pre:
            self.embedding = torch.nn.Embedding(model.vocab_size, h)
            self.positions = torch.nn.Embedding(model.seq_length, h)
        self.blocks = torch.nn.Sequential(*(Block(h, model.num_attention_heads) for _ in range(num_layers)))
        if post:
            self.norm, self.output = torch.nn.LayerNorm(h), torch.nn.Linear(h, model.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.pre:
            positions = torch.arange(x.shape[1])
            x = (self.embedding(x) + self.positions(positions)).transpose(0, 1).contiguous()
        x = self.blocks(x)
        if self.post:
            return self.output(self.norm(x)).transpose(0, 1)
        return x


def plain_stages(model: TinyGPTSpec, layouts: list[Any], num_stages: int) -> list[Any]:
    """torch ``PipelineStage`` s of plain layers for this rank's chunk ``layouts`` (seeded per stage)."""
    from torch.distributed.pipelining import PipelineStage

    s, b, h, vocab = model.seq_length, model.micro_batch_size, model.hidden_size, model.vocab_size
    stages = []
    for layout in layouts:
        torch.manual_seed(model.seed + layout.stage)
        module = PlainStage(model, layout.num_layers, layout.pre_process, layout.post_process)
        inp = torch.zeros(b, s, dtype=torch.long) if layout.pre_process else torch.zeros(s, b, h, requires_grad=True)
        out = (torch.zeros(b, s, vocab) if layout.post_process else torch.zeros(s, b, h)).requires_grad_(True)
        stages.append(
            PipelineStage(module, layout.stage, num_stages, torch.device("cpu"), input_args=inp, output_args=out)
        )
    return stages
