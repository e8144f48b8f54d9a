#!/usr/bin/env python
"""GPT pre-training with megatron-core's training loop and the plugin's pipeline schedules.

Runs ``megatron.training.pretrain()`` of stock megatron-core 0.19.2 exactly as Megatron-LM's
``pretrain_gpt.py`` does, plus three things:

* the plugin's flags (``--pipeline-schedule NAME``, ``--pipeline-schedule-file``, ``--cpu``, ...;
  see ``megatron_pp_ext.integration.arguments``), validated before any process group exists;
* ``megatron_pp_ext.install(args)``, which makes megatron's training loop run the selected
  schedule (without ``--pipeline-schedule`` megatron's own schedule runs, untouched);
* CPU / gloo mode with ``--cpu`` or when CUDA is not available (the shims of
  ``megatron_pp_ext.integration.cpu``; local layer spec, gloo backend, no fused kernels: the flags
  of ``megatron_pp_ext.integration.arguments.CPU_ARGV`` go in front of the command line).
  On GPUs the Transformer Engine layer spec is used when TE imports, else the local one.

Data: Megatron's ``MockGPTDataset`` unless ``--data-path`` (indexed datasets) is given; the
tokenizer then defaults to ``NullTokenizer`` with ``--vocab-size`` (default 256), else to
``GPT2BPETokenizer`` as upstream. ``--eval-interval`` defaults to 1000 (megatron 0.19.2 fails
without one); pass ``--eval-iters 0`` to skip evaluation.

Example (4 CPU processes, tiny model; ``scripts/run_tiny_cpu.sh SCHEDULE NPROC`` wraps it)::

    torchrun --nproc-per-node 4 scripts/pretrain_gpt.py --pipeline-schedule 1f1b --cpu \\
        --pipeline-model-parallel-size 4 --num-layers 8 --hidden-size 64 --num-attention-heads 4 \\
        --seq-length 64 --max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 16 \\
        --train-iters 20 --lr 3e-3 --eval-iters 0 --log-interval 1

Supports GPT pre-training, multi-token prediction (``--mtp-num-layers``) included (no SFT, FIM or packed
sequences: use Megatron-LM's own
``pretrain_gpt.py`` with ``patches/megatron_lm_pretrain_gpt.patch`` for those).
"""

from __future__ import annotations

import atexit
import os
import sys
import time

_PROGRAM_START = time.time()

# Importable from a source checkout without installation.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from megatron_pp_ext.integration import cpu  # noqa: E402  (must come before any megatron import)
from megatron_pp_ext.integration.arguments import (  # noqa: E402
    PipelineArgumentError,
    cpu_argv,
    error_line,
    microbatch_counts,
    validate_arguments_or_exit,
)
from megatron_pp_ext.integration.features.chunk_fsdp import check_argv as check_fsdp_argv  # noqa: E402
from megatron_pp_ext.integration.uneven import megatron_validation_for_placement  # noqa: E402


def _cpu_requested(argv: list[str]) -> bool:
    return "--cpu" in argv or not cpu.cuda_available()


def _transformer_engine_importable() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # not installed, or installed without its CUDA libraries
        return False
    return True


CPU_MODE = _cpu_requested(sys.argv[1:])
if CPU_MODE:
    cpu.hide_missing_accelerator_warnings()  # before megatron's imports warn about them on every rank
    cpu.enable_cpu_training_mode(force=True)
    # The megatron flags a CPU / gloo run needs go first: the user's own flags still win.
    sys.argv[1:] = cpu_argv(sys.argv[1:])
elif "--transformer-impl" not in sys.argv[1:] and not _transformer_engine_importable():
    # megatron's default is the Transformer Engine layer spec: use the local one without TE
    sys.argv[1:] = ["--transformer-impl", "local", *sys.argv[1:]]

from functools import partial  # noqa: E402
from typing import Any  # noqa: E402

from megatron.core import mpu  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer  # noqa: E402
from megatron.core.utils import (  # noqa: E402
    get_attr_wrapped_model,
    get_batch_on_this_cp_rank,
    get_batch_on_this_tp_rank,
)
from megatron.training import get_args, get_timers, pretrain, print_rank_0, set_startup_timestamps  # noqa: E402
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args  # noqa: E402
from megatron.training.arguments import parse_and_validate_args  # noqa: E402
from megatron.training.utils import get_blend_and_blend_per_split  # noqa: E402

import megatron_pp_ext  # noqa: E402
from megatron_pp_ext.integration import layout  # noqa: E402
from megatron_pp_ext.integration.argv_check import check_argv_or_exit  # noqa: E402
from megatron_pp_ext.integration.features import prepare_training  # noqa: E402
from megatron_pp_ext.runtime.agreement import ScheduleMismatchError  # noqa: E402
from megatron_pp_ext.runtime.executor import ExecutorError  # noqa: E402
from megatron_pp_ext.runtime.p2p import PipelineCommError  # noqa: E402

BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


def get_batch(data_iterator: Any, vp_stage: int | None) -> tuple[Any, ...]:
    """This chunk's part of the next micro-batch (``None`` for what the chunk does not use)."""
    args = get_args()
    first, last = layout.chunk_is_first_last(vp_stage)
    mtp = layout.chunk_holds_mtp(args, vp_stage)  # its own embedding of the tokens, and their labels
    if not (first or last or mtp):
        return (None,) * len(BATCH_KEYS)
    tp_rank = mpu.get_tensor_model_parallel_rank()
    batch: dict[str, Any] = {}
    if tp_rank == 0:
        batch = next(data_iterator)
        batch = {key: (value.cuda(non_blocking=True) if value is not None else None) for key, value in batch.items()}
        batch.setdefault("attention_mask", None)
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=False,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=mpu.get_tensor_model_parallel_src_rank(),
        broadcast_group=mpu.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        mtp_on_this_rank=mtp,
        # A chunk that is both first and last (a one-stage pipeline) needs every tensor.
        pipeline_model_parallel_size=1 if (first and last) else args.pipeline_model_parallel_size,
        is_pipeline_first_stage=first,
        is_pipeline_last_stage=last,
    )
    batch.setdefault("cu_seqlens", None)
    batch = get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group())
    return tuple(batch.get(key) for key in BATCH_KEYS)


# Testing aid: with MEGATRON_PP_EXT_LOSS_FILE=PATH every rank computing losses writes the exact
# (float.hex) loss of each micro-batch, in order, to PATH.rank<global rank> at exit.
_LOSS_FILE = os.environ.get("MEGATRON_PP_EXT_LOSS_FILE")
_LOSSES: list[str] = []
_RANK: list[int] = []


def _write_losses() -> None:
    if _LOSSES and _LOSS_FILE:
        with open(f"{_LOSS_FILE}.rank{_RANK[0]}", "w") as out:
            out.write("\n".join(_LOSSES) + "\n")


if _LOSS_FILE:
    atexit.register(_write_losses)
_LOSS_MARK = [0]


def _drop_discarded_losses(event: str) -> None:
    """Post-validation (late) runs a forward-backward again when validation changed weights: the losses
    of the discarded pass are not the iteration's."""
    if event == "start":
        _LOSS_MARK[0] = len(_LOSSES)
    elif event == "discard":
        del _LOSSES[_LOSS_MARK[0] :]


# Testing aid: with MEGATRON_PP_EXT_WEIGHTS_FILE=PATH every rank saves its model parameters after training
# (torch.save of {"<chunk>.<name>": tensor}) to PATH.rank<global rank>.
_WEIGHTS_FILE = os.environ.get("MEGATRON_PP_EXT_WEIGHTS_FILE")


def _save_weights_after_training() -> None:
    import megatron.training.training as training

    original = training.train

    def train(forward_step_func: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(forward_step_func, model, *args, **kwargs)
        weights = {
            f"{i}.{name}": param.detach().clone().cpu()
            for i, chunk in enumerate(model)
            for name, param in chunk.named_parameters()
        }
        torch.save(weights, f"{_WEIGHTS_FILE}.rank{torch.distributed.get_rank()}")
        return result

    training.train = train


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Sum of the masked token losses, the token count, and the report for Megatron's log."""
    losses = output_tensor.view(-1).float()
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    if _LOSS_FILE:
        _RANK[:] = [torch.distributed.get_rank()]
        _LOSSES.append(float(loss.detach()).hex())
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator: Any, model: Any, return_schedule_plan: bool = False) -> tuple[Any, Any]:
    """Megatron's forward-step contract: the chunk's output (or, when megatron's combined 1F1B asks with
    ``return_schedule_plan``, the chunk's schedule plan) and a loss function for it."""
    timers = get_timers()
    timers("batch-generator", log_level=2).start()
    vp_stage = get_attr_wrapped_model(model, "vp_stage")
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator, vp_stage)
    timers("batch-generator").stop()
    if return_schedule_plan:
        # megatron's combined 1F1B (--overlap-moe-expert-parallel-comm) asks for the chunk's schedule
        # plan, run node by node beside another micro-batch's backward, instead of its output
        plan = model.build_schedule_plan(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
        return plan, partial(loss_func, loss_mask)
    output = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output, partial(loss_func, loss_mask)


def dataset_config(args: Any) -> GPTDatasetConfig:
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=build_tokenizer(args),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
    )


def is_dataset_built_on_rank(vp_stage: int | None = None) -> bool:
    if mpu.get_tensor_model_parallel_rank() != 0:
        return False
    first, last = layout.chunk_is_first_last(vp_stage)
    return first or last or layout.chunk_holds_mtp(get_args(), vp_stage)


def train_valid_test_datasets_provider(num_samples: list[int], vp_stage: int | None = None) -> tuple[Any, Any, Any]:
    args = get_args()
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building train, validation, and test datasets for GPT ({dataset_type.__name__}) ...")
    datasets = BlendedMegatronDatasetBuilder(
        dataset_type, num_samples, partial(is_dataset_built_on_rank, vp_stage), dataset_config(args)
    ).build()
    print_rank_0("> finished creating GPT datasets ...")
    return datasets


train_valid_test_datasets_provider.is_distributed = True  # type: ignore[attr-defined]


def _argv_has(flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in sys.argv[1:])


def describe(args: Any) -> str:
    """One line saying which schedule runs instead of megatron's."""
    config = megatron_pp_ext.pipeline_config_of(args)
    m = microbatch_counts(args)[0][-1]
    schedule = config.build(args.pipeline_model_parallel_size, m)
    placement = schedule.placement
    block = f", building block {schedule.params['block']!r}" if "block" in schedule.params else ""
    return (
        f"pipeline schedule '{schedule.name}' replaces megatron's ({placement.style} placement, "
        f"p={placement.num_ranks}, {placement.chunks_per_rank} chunk(s) per rank, m={m} micro-batches per iteration"
        f"{block})"
    )


def _tolerate_bad_help_strings() -> None:
    """``--help``: megatron-core 0.19.2 has a help string with a bare ``%`` that crashes argparse's
    formatting; print such a help string as it is instead of failing."""
    import argparse

    original = argparse.HelpFormatter._expand_help

    def expand_help(self: argparse.HelpFormatter, action: argparse.Action) -> str:
        try:
            return original(self, action)
        except (ValueError, TypeError, KeyError):
            return str(action.help)

    argparse.HelpFormatter._expand_help = expand_help  # type: ignore[method-assign]


def _check_environment_or_exit() -> None:
    """The plugin's timeout variables (MEGATRON_PP_P2P_TIMEOUT, MEGATRON_PP_AGREE_TIMEOUT), before any work."""
    from megatron_pp_ext.runtime.agreement import agree_timeout_s
    from megatron_pp_ext.runtime.p2p import timeout_from_env

    try:
        timeout_from_env()
        agree_timeout_s()
    except ValueError as exc:
        error_line(os.path.basename(sys.argv[0]), exc)
        raise SystemExit(2) from None


def main(model_config_from_args: Any = gpt_config_from_args) -> None:
    """Parse and check the flags, install the plugin's schedule, run ``pretrain()`` on the model that
    ``model_config_from_args(args)`` configures (a GPTModel here; ``pretrain_hybrid.py``: a HybridModel)."""
    _tolerate_bad_help_strings()
    set_startup_timestamps(program_start=_PROGRAM_START, main_entry=time.time())
    mock = not (_argv_has("--data-path") or _argv_has("--train-data-path") or _argv_has("--data-args-path"))
    # megatron 0.19.2 divides by --eval-interval whenever a validation set exists: give it a default.
    defaults: dict[str, Any] = {"eval_interval": 1000}
    if mock and not _argv_has("--tokenizer-type"):
        defaults.update(tokenizer_type="NullTokenizer", vocab_size=256)
    elif not _argv_has("--tokenizer-type"):
        defaults.update(tokenizer_type="GPT2BPETokenizer")
    check_argv_or_exit(sys.argv[1:])  # one line per mistyped flag or bad value, not megatron's usage per rank
    try:  # megatron's own validation would reject these with a traceback
        check_fsdp_argv(sys.argv[1:])
    except PipelineArgumentError as exc:
        if os.environ.get("RANK", "0") == "0":
            error_line(os.path.basename(sys.argv[0]), exc)
        raise SystemExit(2) from None
    with megatron_validation_for_placement():  # a layout string of a V / bidirectional schedule is ours
        args = parse_and_validate_args(extra_args_provider=megatron_pp_ext.add_arguments, args_defaults=defaults)
    if mock:
        args.mock_data = True
    if CPU_MODE:
        args.cpu = True
    validate_arguments_or_exit(args)  # before any process group exists
    _check_environment_or_exit()
    # a checkpoint megatron cannot read (status 0 there), or a torch-format one of another placement (loads
    # nothing or the wrong layers there), stops the run; one run at a time saves into a --save directory
    prepare_training(args)  # integration/features/checkpoint_safety.py
    try:  # --pipeline-schedule auto is decided here (the planner's search), then checked like a named one
        installed = megatron_pp_ext.install(args)
    except PipelineArgumentError as exc:
        if os.environ.get("RANK", "0") == "0":
            error_line(os.path.basename(sys.argv[0]), exc)
        raise SystemExit(2) from None
    if installed is not None:
        print_rank_0(f"> megatron_pp_ext: {describe(args)}")
    else:  # megatron untouched without --pipeline-schedule, but a peer started with one learns it at once
        from megatron_pp_ext.integration.features.config_agreement import agree_without_schedule

        agree_without_schedule(args)
    if _LOSS_FILE and getattr(args, "pipeline_post_validation", False):
        from megatron_pp_ext.integration import post_validation_training

        post_validation_training.add_listener(_drop_discarded_losses)
    if _WEIGHTS_FILE:  # after install(): wraps post-validation's train (validated last step)
        _save_weights_after_training()
    model_cfg = model_config_from_args(args)
    try:
        pretrain(
            pretrain_cfg_container_from_args(args, model_cfg),
            train_valid_test_datasets_provider,
            ModelType.encoder_or_decoder,
            forward_step,
            get_embedding_ranks=layout.get_embedding_ranks,
            get_position_embedding_ranks=layout.get_position_embedding_ranks,
        )
    except (ScheduleMismatchError, PipelineCommError, ExecutorError) as exc:
        # One line, and out at once: the peers stop on the same check, or are stuck waiting on this rank.
        error_line(os.path.basename(sys.argv[0]), exc)
        os._exit(1)
    # Shut the process groups down before the interpreter does: a gloo group still alive at exit
    # can abort in its threads' destructors ("terminate called without an active exception").
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
