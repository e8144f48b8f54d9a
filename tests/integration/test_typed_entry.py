"""The typed entry (integration/entry.py): ``install(PipelineConfig(run=RunShape(...)))`` checks and decides what
``install(args)`` does for the same run, and refuses in one line what it cannot do without megatron's args."""

from __future__ import annotations

from typing import Any

import pytest
from megatron_args_helpers import TINY_SHAPE, make_args

from megatron_pp_ext.integration.arguments import validate_arguments
from megatron_pp_ext.integration.auto_schedule import resolve as resolve_args
from megatron_pp_ext.integration.config import PipelineArgumentError, PipelineConfig
from megatron_pp_ext.integration.entry import RunShape, resolve

P4 = {"pipeline_model_parallel_size": 4}


def _run(**overrides: Any) -> RunShape:
    return RunShape(**{**TINY_SHAPE, **P4, **overrides})


def test_a_named_schedule_is_checked_against_the_run_as_its_flags_are() -> None:
    config, args = resolve(PipelineConfig(schedule="v-half", run=_run()))
    assert config.num_virtual_stages == 2 and args.virtual_pipeline_model_parallel_size == 2  # V: 2 chunks per rank
    bad = _run(num_layers=5, pipeline_model_parallel_size=2)
    with pytest.raises(PipelineArgumentError, match="argument --num-layers: 5 layers do not split evenly") as info:
        resolve(PipelineConfig(schedule="zb-h1", run=bad))
    assert "\n" not in str(info.value)
    with pytest.raises(PipelineArgumentError, match="argument --pipeline-memory-limit"):
        resolve(PipelineConfig(schedule="zb-h1", memory_limit=3.0, run=_run()))


def test_auto_decides_what_install_args_decides_for_the_same_run(capsys: pytest.CaptureFixture[str]) -> None:
    typed, args = resolve(PipelineConfig(schedule="auto", memory_budget=4.0, cpu=True, run=_run()))
    flags = make_args(["--pipeline-schedule", "auto", "--cpu", "--pipeline-memory-budget", "4"], **TINY_SHAPE)
    from_args = resolve_args(flags, validate_arguments(flags))
    assert typed.schedule not in (None, "auto")
    assert (typed.schedule, typed.num_virtual_stages, typed.memory_limit) == (
        from_args.schedule,
        from_args.num_virtual_stages,
        from_args.memory_limit,
    )
    assert typed.auto_table == from_args.auto_table
    assert args.virtual_pipeline_model_parallel_size == from_args.num_virtual_stages  # megatron's chunk count set


def test_what_needs_megatron_args_or_training_is_refused_in_one_line() -> None:
    with pytest.raises(PipelineArgumentError, match="--pipeline-schedule: auto needs the run's model and batch"):
        resolve(PipelineConfig(schedule="auto", memory_budget=4.0))
    with pytest.raises(PipelineArgumentError, match="--pipeline-fsdp: replaces megatron"):
        resolve(PipelineConfig(schedule="bfs", fsdp=True, run=_run()))
    with pytest.raises(PipelineArgumentError, match="--pipeline-schedule auto on CPU needs a budget"):
        resolve(PipelineConfig(schedule="auto", cpu=True, run=_run()))
    with pytest.raises(PipelineArgumentError, match="--pipeline-model-parallel-size"):
        resolve(PipelineConfig(schedule="1f1b", pipeline_parallel_size=2, run=_run()))
    named, args = resolve(PipelineConfig(schedule="1f1b", pipeline_parallel_size=2))  # no run: as given
    assert named.schedule == "1f1b" and args is None


def test_run_shape_from_megatron_transformer_config(megatron: Any) -> None:
    import torch
    from megatron.core.transformer import TransformerConfig

    model = TransformerConfig(
        num_layers=8,
        hidden_size=64,
        num_attention_heads=4,
        pipeline_model_parallel_size=2,
        pipeline_dtype=torch.float32,
        gated_linear_unit=True,
        num_layers_in_first_pipeline_stage=3,
        num_layers_in_last_pipeline_stage=5,
    )
    run = RunShape.from_transformer_config(model, micro_batch_size=1, global_batch_size=8, seq_length=64)
    assert (run.num_layers, run.hidden_size, run.pipeline_model_parallel_size, run.swiglu) == (8, 64, 2, True)
    assert run.seq_length == 64 and run.micro_batch_size == 1
    args = run.as_args()
    assert (args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers) == (3, 5)
    config, _ = resolve(PipelineConfig(schedule="v-zb", run=run))  # 3 + 5 layers over V's 4 model stages
    assert config.layer_split is not None and config.num_virtual_stages == 2


def test_install_takes_the_typed_config(megatron: Any) -> None:
    from megatron.core.pipeline_parallel import schedules

    from megatron_pp_ext.integration import install as inst

    inst.uninstall()
    try:
        func = inst.install(PipelineConfig(schedule="zb-h1", run=_run(pipeline_model_parallel_size=2)))
        assert func is not None and schedules.get_forward_backward_func() is func
        installed = inst.installed()
        assert installed is not None and installed.schedule == "zb-h1" and installed.pipeline_parallel_size == 2
    finally:
        inst.uninstall()
