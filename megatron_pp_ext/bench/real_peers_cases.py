"""What ``megatron-pp bench --real-peers`` runs: each of our schedules with its peer in torch.distributed.pipelining,
the two model sizes and the micro-batch count. Plain data (no torch at import: the command line parses against it).
"""

from __future__ import annotations

from typing import Any

#: our schedule -> torch.distributed.pipelining's class for the same order of work
TORCH_PEERS = {
    "1f1b": "Schedule1F1B",
    "gpipe": "ScheduleGPipe",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "v-zb": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
    "bfs": "ScheduleLoopedBFS",
}
#: torch's schedules that split the backward themselves (their run on plain layers is added to the table)
TORCH_SPLIT = ("ScheduleInterleavedZeroBubble", "ScheduleZBVZeroBubble", "ScheduleDualPipeV")
#: chunks per rank of our loop-placed schedules with virtual stages (V placements imply two)
LOOP_CHUNKS = {"interleaved-1f1b": 2, "interleaved-zb": 2, "bfs": 2}
#: the two model sizes (TinyGPTSpec fields): one where the host cost per op shows, one whose ops take >= 20 ms on
#: one thread even at one layer per stage
SIZE_SHAPES: dict[str, dict[str, int]] = {
    "tiny": {
        "num_layers": 8,
        "hidden_size": 128,
        "num_attention_heads": 4,
        "seq_length": 64,
        "vocab_size": 512,
        "micro_batch_size": 2,
    },
    "large": {
        "num_layers": 8,
        "hidden_size": 512,
        "num_attention_heads": 8,
        "seq_length": 256,
        "vocab_size": 2048,
        "micro_batch_size": 2,
    },
}

#: timed iterations per size, as a multiple of ``--iterations``: a tiny iteration takes about 1/25 of a large one,
#: and its ratios, a few percent apart at 100 ms an iteration, need more pairs to settle
ITERATION_FACTOR = {"tiny": 5, "large": 1}


def iterations_of(size: str, iterations: int, warmup: int) -> int:
    """Iterations of a case at ``size`` (warm-up included): ``warmup`` + the factor x the timed ``iterations -
    warmup``."""
    return warmup + ITERATION_FACTOR[size] * (iterations - warmup)


def model_spec(size: str) -> Any:
    """The ``TinyGPTSpec`` of size ``size`` (a key of :data:`SIZE_SHAPES`)."""
    from ..verification.tiny_gpt import TinyGPTSpec

    return TinyGPTSpec(**SIZE_SHAPES[size])


def num_microbatches(p: int) -> int:
    """m = 2p: every schedule of the table accepts it (DualPipeV needs m >= 2p, torch's interleaving m % p == 0)."""
    return 2 * p


def describe(size: str) -> str:
    shape = SIZE_SHAPES[size]
    return (
        f"{size}: {shape['num_layers']} layers, hidden {shape['hidden_size']}, seq {shape['seq_length']}, "
        f"vocab {shape['vocab_size']}, micro-batch {shape['micro_batch_size']}"
    )
