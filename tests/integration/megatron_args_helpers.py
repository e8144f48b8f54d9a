"""Megatron-style args for the plugin's argument tests (no megatron import)."""

from __future__ import annotations

import argparse
from typing import Any

from megatron_pp_ext.integration.flags import add_arguments

#: scripts/run_tiny_cpu.sh's model and batch shapes (no dropout), for auto's argument tests
TINY_SHAPE: dict[str, Any] = {
    "num_layers": 8,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_length": 64,
    "vocab_size": 256,
    "micro_batch_size": 2,
    "global_batch_size": 16,
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
}

MEGATRON_DEFAULTS: dict[str, Any] = {
    # the megatron args validate_arguments reads, as megatron's parse_and_validate_args leaves them
    "pipeline_model_parallel_size": 4,
    "virtual_pipeline_model_parallel_size": None,
    "num_virtual_stages_per_pipeline_rank": None,
    "num_layers_per_virtual_pipeline_stage": None,
    "pipeline_model_parallel_layout": None,
    "decoder_first_pipeline_num_layers": None,
    "decoder_last_pipeline_num_layers": None,
    "account_for_embedding_in_pipeline_split": False,
    "account_for_loss_in_pipeline_split": False,
    "microbatch_group_size_per_vp_stage": None,
    "overlap_moe_expert_parallel_comm": False,
    "num_layers": 8,
    "micro_batch_size": 1,
    "global_batch_size": 8,
    "data_parallel_size": 1,
    "rampup_batch_size": None,
    "eval_iters": 0,
    "eval_global_batch_size": None,
    "eval_micro_batch_size": None,
    "distributed_backend": "gloo",
    "transformer_impl": "local",
    "gradient_accumulation_fusion": False,
}


def make_parser() -> argparse.ArgumentParser:
    return add_arguments(argparse.ArgumentParser(prog="pretrain_gpt.py", allow_abbrev=False))


def make_args(argv: list[str] | None = None, **megatron: Any) -> argparse.Namespace:
    """Our flags parsed from ``argv`` plus megatron's (already validated) args."""
    args = make_parser().parse_args(argv or [])
    for key, value in {**MEGATRON_DEFAULTS, **megatron}.items():
        setattr(args, key, value)
    return args
