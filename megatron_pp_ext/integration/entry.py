"""The typed entry: ``install(PipelineConfig(...))`` for training scripts without megatron's argparse.

A script that builds its model with megatron-core directly (its own loop, Megatron-Bridge) has no megatron
``args``. It gives the plugin's settings as a :class:`~.config.PipelineConfig` and, for everything the
checks and ``--pipeline-schedule auto`` read from megatron's ``args`` (model shape, parallel sizes, batch),
a :class:`RunShape` in ``PipelineConfig.run``. :func:`resolve` turns the two into a stand-in for megatron's
``args`` (:meth:`RunShape.as_args`: the same attribute names) carrying the configuration's values as the
flags would, and runs the very checks ``install(args)`` runs (:func:`~.arguments.validate_arguments`, then
auto's decision, :func:`~.auto_schedule.resolve`). A refusal therefore reads as for the command line: one
``argument --flag: ...`` line, where ``--flag`` is the megatron flag of the :class:`RunShape` field of the
same name (``--num-layers`` for ``num_layers``) or the plugin flag of the configuration field.

Without a :class:`RunShape`, a named schedule is installed as given (built per micro-batch count at the first
step, from megatron's parallel state); what cannot be decided or honoured without the run's shape or
megatron's training loop is refused in one line (``auto`` without a run; :data:`NEEDS_MEGATRON_TRAINING`).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .config import AUTO, PipelineArgumentError, PipelineConfig

__all__ = ["NEEDS_MEGATRON_TRAINING", "NOT_WITHOUT_TRAINING", "RunShape", "args_for", "resolve"]

#: configuration fields (their flag) that work only inside megatron.training's ``pretrain()``: they replace
#: functions of megatron.training that a script of its own (or Megatron-Bridge) never calls
NEEDS_MEGATRON_TRAINING = (("fsdp", "--pipeline-fsdp"),)
NOT_WITHOUT_TRAINING = (
    "replaces megatron.training's DDP wrapping and optimizer set-up, which only megatron.training's pretrain() "
    "calls: use install(args) in a megatron-args script, or megatron's --use-distributed-optimizer / Megatron-FSDP"
)


@dataclass(frozen=True)
class RunShape:
    """What the checks and auto read from megatron's ``args``, by the same names (megatron's flag dests).

    ``data_parallel_size``: the data-parallel replicas (world / (TP x PP x CP)). ``micro_batch_size`` and
    ``global_batch_size`` give the micro-batches per iteration, which every schedule is checked for (and
    ``eval_*`` those of evaluation when ``eval_iters`` > 0). ``extra``: any other megatron attribute by name
    (``decoder_first_pipeline_num_layers``, ``hybrid_layer_pattern``, ``num_experts``, ...).
    """

    num_layers: int
    micro_batch_size: int
    global_batch_size: int
    pipeline_model_parallel_size: int
    hidden_size: int | None = None
    num_attention_heads: int | None = None
    seq_length: int | None = None
    vocab_size: int | None = None
    ffn_hidden_size: int | None = None
    num_query_groups: int | None = None
    swiglu: bool = False
    untie_embeddings_and_output_weights: bool = False
    tensor_model_parallel_size: int = 1
    context_parallel_size: int = 1
    data_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    sequence_parallel: bool = False
    recompute_granularity: str | None = None
    bf16: bool = False
    fp16: bool = False
    use_distributed_optimizer: bool = False
    transformer_impl: str = "local"
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    eval_iters: int = 0
    eval_global_batch_size: int | None = None
    eval_micro_batch_size: int | None = None
    rampup_batch_size: tuple[int, int, int] | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @classmethod
    def from_transformer_config(
        cls,
        config: Any,
        *,
        micro_batch_size: int,
        global_batch_size: int,
        data_parallel_size: int = 1,
        **more: Any,
    ) -> RunShape:
        """From megatron's ``TransformerConfig`` (or a Bridge model provider, which is one) and the batch.

        The model shape, parallel sizes, precision and recompute are read from ``config``; ``seq_length`` and
        ``vocab_size`` too where it has them (Bridge's providers do), else from ``more``. ``more`` sets any
        field (or, for other names, ``extra``)."""
        fields = {f.name for f in dataclasses.fields(cls)}
        read: dict[str, Any] = {}
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "seq_length",
            "vocab_size",
            "ffn_hidden_size",
            "num_query_groups",
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "virtual_pipeline_model_parallel_size",
            "sequence_parallel",
            "recompute_granularity",
            "bf16",
            "fp16",
            "hidden_dropout",
            "attention_dropout",
        ):
            value = getattr(config, name, None)
            if value is not None:
                read[name] = value
        read["swiglu"] = bool(getattr(config, "gated_linear_unit", False))
        share = getattr(config, "share_embeddings_and_output_weights", None)
        if share is not None:
            read["untie_embeddings_and_output_weights"] = not share
        extra: dict[str, Any] = {}
        for name in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
            if getattr(config, name, None) is not None:  # megatron's flags of the same split
                extra[name.replace("num_layers_in_", "decoder_").replace("_stage", "_num_layers")] = getattr(
                    config, name
                )
        for name in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
            if getattr(config, name, False):
                extra[name] = True
        for name, value in more.items():
            if name in fields and name != "extra":
                read[name] = value
            else:
                extra[name] = value
        return cls(
            micro_batch_size=micro_batch_size,
            global_batch_size=global_batch_size,
            data_parallel_size=data_parallel_size,
            **read,
            extra=extra,
        )

    def as_args(self) -> argparse.Namespace:
        """A stand-in for megatron's parsed ``args`` with this run's values (``extra`` included)."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        values["rampup_batch_size"] = list(self.rampup_batch_size) if self.rampup_batch_size else None
        values["group_query_attention"] = self.num_query_groups is not None
        # a chunk count the run gives is the user's, as megatron's virtual pipeline flag (a schedule placing
        # another count is refused naming it); without one the schedule's placement sets it
        values["num_virtual_stages_per_pipeline_rank"] = self.virtual_pipeline_model_parallel_size
        values["num_layers_per_virtual_pipeline_stage"] = None
        values["padded_vocab_size"] = self.vocab_size
        return argparse.Namespace(**{**values, **self.extra})


def args_for(config: PipelineConfig, run: RunShape) -> argparse.Namespace:
    """megatron-style ``args`` for ``run`` holding ``config``'s values as the ``--pipeline-*`` flags would."""
    from .flags import flag_fields

    args = run.as_args()
    for name, spec in flag_fields():
        setattr(args, spec.dest, getattr(config, name))
    if config.num_virtual_stages is not None:  # the user asked for these chunks, as megatron's flag would
        args.virtual_pipeline_model_parallel_size = config.num_virtual_stages
        args.num_virtual_stages_per_pipeline_rank = config.num_virtual_stages
    if config.microbatch_group_size is not None:
        args.microbatch_group_size_per_vp_stage = config.microbatch_group_size
    return args


def resolve(config: PipelineConfig) -> tuple[PipelineConfig, Any]:
    """The configuration to install for a typed ``config``, and the ``args`` stand-in it was checked with
    (``None`` without a :attr:`PipelineConfig.run`). Raises :class:`PipelineArgumentError` (one line)."""
    run = config.run
    if run is None:
        if config.schedule == AUTO:
            raise PipelineArgumentError(
                "--pipeline-schedule",
                "auto needs the run's model and batch: give PipelineConfig(run=RunShape(...)) (or "
                "RunShape.from_transformer_config(...)), or call install(args) with megatron's args",
            )
        return config, None
    if not isinstance(run, RunShape):
        raise PipelineArgumentError("--pipeline-schedule", f"PipelineConfig.run must be a RunShape, got {type(run)}")
    for name, flag in NEEDS_MEGATRON_TRAINING:
        if getattr(config, name):
            raise PipelineArgumentError(flag, NOT_WITHOUT_TRAINING)
    if config.pipeline_parallel_size not in (None, run.pipeline_model_parallel_size):
        raise PipelineArgumentError(
            "--pipeline-model-parallel-size",
            f"PipelineConfig.pipeline_parallel_size={config.pipeline_parallel_size} but the run has "
            f"pipeline_model_parallel_size={run.pipeline_model_parallel_size}",
        )
    from .arguments import validate_arguments

    args = args_for(config, run)
    checked = validate_arguments(args)
    if checked.schedule == AUTO:
        from .auto_schedule import resolve as decide

        checked = decide(args, checked)
    return checked, args
