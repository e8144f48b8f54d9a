#!/usr/bin/env python
"""HybridModel pre-training with megatron-core's training loop and the plugin's pipeline schedules.

Megatron-LM keeps hybrid models (``--hybrid-layer-pattern``: ``*`` attention, ``-`` MLP, ``E`` MoE,
``M`` Mamba, ``|`` between pipeline stages) in a driver of their own, ``pretrain_hybrid.py``, which
differs from ``pretrain_gpt.py`` in the model it configures (``hybrid_config_from_args``). This one
does the same on top of ``scripts/pretrain_gpt.py``: the same flags, data, checks and plugin
installation, with a ``HybridModel`` instead of the deprecated ``GPTModel``.

Where each chunk's layers come from: stage ``s`` of the schedule's placement builds segment ``s`` of
the pattern (docs/hybrid.md); a pattern that does not fit the schedule stops with one line before any
process group. On CPU (or with ``--transformer-impl local``) the model is built from megatron-core's
local modules (``megatron_pp_ext.integration.hybrid``): ``*``, ``-`` and ``E`` layers; Mamba and the
other layer types need Transformer Engine and their kernels.

Example (2 CPU processes)::

    torchrun --nproc-per-node 2 scripts/pretrain_hybrid.py --pipeline-schedule zb-h1 --cpu \\
        --pipeline-model-parallel-size 2 --hybrid-layer-pattern '*-*-|*-*-' --hidden-size 64 \\
        --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 \\
        --global-batch-size 16 --train-iters 20 --lr 3e-3 --eval-iters 0 --log-interval 1
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pretrain_gpt  # sets up CPU mode before megatron is imported
from megatron.training.argument_utils import hybrid_config_from_args

from megatron_pp_ext.integration.arguments import error_line


def hybrid_model_config(args: Any) -> Any:
    """Megatron's HybridModel configuration; megatron-core's local modules without Transformer Engine."""
    config = hybrid_config_from_args(args)
    if getattr(args, "transformer_impl", "local") == "local" and config.hybrid_stack_spec is None:
        from megatron_pp_ext.integration.hybrid import local_hybrid_stack_spec, use_local_final_norm

        use_local_final_norm()
        experts = getattr(args, "num_experts", None) if "E" in args.hybrid_layer_pattern else None
        config.hybrid_stack_spec = local_hybrid_stack_spec(experts)
    return config


if __name__ == "__main__":
    asks_help = any(a in ("-h", "--help") for a in sys.argv[1:])  # megatron-pp grid --check reads the flags
    if not asks_help and not any(
        a == "--hybrid-layer-pattern" or a.startswith("--hybrid-layer-pattern=") for a in sys.argv[1:]
    ):
        if os.environ.get("RANK", "0") == "0":
            error_line(os.path.basename(sys.argv[0]), "argument --hybrid-layer-pattern: required (e.g. '*-*-|*-*-')")
        raise SystemExit(2)
    pretrain_gpt.main(hybrid_model_config)
