"""The plugin's flags and their validation: pure and fast (no megatron, no processes)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from megatron_args_helpers import make_args, make_parser

from megatron_pp_ext.integration.arguments import validate_arguments, validate_arguments_or_exit
from megatron_pp_ext.integration.config import (
    ActivationLimit,
    PipelineArgumentError,
    parse_pipeline_costs,
    parse_pipeline_memory_limit,
)
from megatron_pp_ext.schedules import registry
from megatron_pp_ext.schedules.generators.baselines import one_f_one_b
from megatron_pp_ext.schedules.ir import BW, F
from megatron_pp_ext.schedules.placement import loop_placement
from megatron_pp_ext.schedules.schedule import build_schedule


def error_of(args: object) -> PipelineArgumentError:
    with pytest.raises(PipelineArgumentError) as info:
        validate_arguments(args)
    return info.value


def test_flags_are_in_their_own_group() -> None:
    parser = make_parser()
    titles = [g.title for g in parser._action_groups]
    assert "pipeline schedules (megatron_pp_ext)" in titles
    help_text = parser.format_help()
    for flag in ("--pipeline-schedule", "--pipeline-schedule-file", "--pipeline-memory-limit", "--pipeline-costs"):
        assert flag in help_text
    assert "--pipeline-trace" in help_text and "--cpu" in help_text


def test_unknown_name_lists_valid_names(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--pipeline-schedule", "nope"])
    err = capsys.readouterr().err
    assert "argument --pipeline-schedule" in err and "'nope'" in err
    for name in registry.names():
        assert name in err


def test_unknown_name_set_programmatically_is_rejected_too() -> None:
    args = make_args()
    args.pipeline_schedule = "zb-h9"
    err = error_of(args)
    assert err.flag == "--pipeline-schedule"
    assert "1f1b" in str(err) and "interleaved-1f1b" in str(err)


def test_names_are_case_insensitive() -> None:
    args = make_args(["--pipeline-schedule", " 1F1B "])
    assert args.pipeline_schedule == "1f1b"
    assert validate_arguments(args).schedule == "1f1b"


def test_no_schedule_leaves_args_alone() -> None:
    args = make_args()
    before = dict(vars(args))
    config = validate_arguments(args)
    assert not config.selected
    after = dict(vars(args))
    assert after == before


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--pipeline-memory-limit", "2p"], "--pipeline-memory-limit"),
        (["--pipeline-costs", "1,2,1"], "--pipeline-costs"),
    ],
)
def test_schedule_options_need_a_schedule(argv: list[str], flag: str) -> None:
    assert error_of(make_args(argv)).flag == flag


def test_name_and_file_conflict(tmp_path: object) -> None:
    err = error_of(make_args(["--pipeline-schedule", "1f1b", "--pipeline-schedule-file", "x.csv"]))
    assert str(err).startswith("argument --pipeline-schedule-file: not allowed with argument --pipeline-schedule")


def test_fewer_microbatches_than_ranks() -> None:
    # 1F1B runs any m >= 1 ...
    validate_arguments(make_args(["--pipeline-schedule", "1f1b"], global_batch_size=2))
    # ... megatron's interleaved 1F1B needs m >= p
    err = error_of(make_args(["--pipeline-schedule", "interleaved-1f1b"], global_batch_size=2))
    assert err.flag == "--global-batch-size"
    text = str(err)
    assert text.startswith("argument --global-batch-size: pipeline schedule 'interleaved-1f1b'")
    assert "m=2" in text and "p=4" in text and "m must be >= p" in text
    assert "valid for interleaved-1f1b: " + registry.get("interleaved-1f1b").requirements in text


def test_microbatch_count_uses_data_parallel_size() -> None:
    # 16 / (1 x 4) = 4 micro-batches: enough; 16 / (2 x 4) = 2: not
    validate_arguments(
        make_args(["--pipeline-schedule", "interleaved-1f1b"], global_batch_size=16, data_parallel_size=4)
    )
    err = error_of(
        make_args(
            ["--pipeline-schedule", "interleaved-1f1b"], global_batch_size=16, micro_batch_size=2, data_parallel_size=4
        )
    )
    assert "data-parallel 4" in str(err)


def test_evaluation_microbatch_count_is_checked() -> None:
    err = error_of(
        make_args(
            ["--pipeline-schedule", "interleaved-1f1b"], global_batch_size=8, eval_iters=10, eval_global_batch_size=2
        )
    )
    assert "m=2" in str(err)


def test_layers_must_split_into_the_placement_stages() -> None:
    err = error_of(make_args(["--pipeline-schedule", "1f1b"], num_layers=6))
    assert str(err).startswith("argument --num-layers: 6 layers do not split evenly into the 4 pipeline stages")
    # interleaved with v=2: 8 stages
    err = error_of(make_args(["--pipeline-schedule", "interleaved-1f1b"], num_layers=12))
    assert "8 pipeline stages" in str(err) and "multiple of 8" in str(err)
    validate_arguments(make_args(["--pipeline-schedule", "interleaved-1f1b"], num_layers=16))


def test_uneven_layer_splits_are_megatrons_business_for_loop_placements() -> None:
    validate_arguments(make_args(["--pipeline-schedule", "1f1b"], num_layers=7, decoder_first_pipeline_num_layers=1))


def test_interleaved_takes_v_from_megatrons_virtual_pipeline_flags() -> None:
    args = make_args(
        ["--pipeline-schedule", "interleaved-1f1b"],
        num_layers=16,
        num_virtual_stages_per_pipeline_rank=4,
        virtual_pipeline_model_parallel_size=4,
    )
    config = validate_arguments(args)
    assert config.num_virtual_stages == 4
    assert config.build(4, 8).chunks_per_rank == 4


def test_interleaved_default_chunks_are_written_back_for_megatron() -> None:
    args = make_args(["--pipeline-schedule", "interleaved-1f1b"])
    config = validate_arguments(args)
    assert args.virtual_pipeline_model_parallel_size == 2
    assert args.num_virtual_stages_per_pipeline_rank == 2
    assert config.num_virtual_stages == 2


def test_one_chunk_schedule_with_a_virtual_pipeline_flag() -> None:
    args = make_args(
        ["--pipeline-schedule", "1f1b"], num_virtual_stages_per_pipeline_rank=2, virtual_pipeline_model_parallel_size=2
    )
    err = error_of(args)
    assert err.flag == "--num-virtual-stages-per-pipeline-rank"
    assert "v must be 1" in str(err)


def test_microbatch_group_size_goes_to_interleaved_only() -> None:
    # megatron's flag is passed to the schedule that takes it ...
    err = error_of(make_args(["--pipeline-schedule", "interleaved-1f1b"], microbatch_group_size_per_vp_stage=16))
    assert err.flag == "--microbatch-group-size-per-virtual-pipeline-stage"
    # ... and ignored by schedules without micro-batch groups
    validate_arguments(make_args(["--pipeline-schedule", "1f1b"], microbatch_group_size_per_vp_stage=16))


def test_memory_limit_is_refused_by_fixed_memory_schedules() -> None:
    err = error_of(make_args(["--pipeline-schedule", "1f1b", "--pipeline-memory-limit", "2p"]))
    assert err.flag == "--pipeline-memory-limit"
    assert "memory_limit" in str(err)


OVERLAP = {
    "overlap_moe_expert_parallel_comm": True,
    "num_experts": 4,
    "expert_model_parallel_size": 2,
    "moe_token_dispatcher_type": "alltoall",
    "bf16": True,
}


@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b", "zb-h1", "v-zb", "dualpipev"])
def test_moe_overlap_is_accepted_with_schedules_that_pair_ops(name: str) -> None:
    validate_arguments(make_args(["--pipeline-schedule", name], **OVERLAP))


@pytest.mark.parametrize(
    ("megatron", "flag", "reason"),
    [
        ({"recompute_granularity": "full"}, "--recompute-granularity", "disable full recomputation"),
        ({"recompute_method": "uniform"}, "--recompute-method", "disable recomputation method"),
        ({"recompute_num_layers": 1}, "--recompute-num-layers", "recompute_num_layers must be None"),
        ({"recompute_modules": ["moe"]}, "--recompute-modules", "disable moe in recompute_modules"),
        ({"mtp_num_layers": 2}, "--mtp-num-layers", "MTP supports at most one layer"),
        ({"expert_model_parallel_size": 1}, "--expert-model-parallel-size", "only supported with expert model"),
        ({"moe_token_dispatcher_type": "allgather"}, "--moe-token-dispatcher-type", "alltoall/flex"),
        ({"moe_shared_expert_overlap": True}, "--moe-shared-expert-overlap", "disable moe_shared_expert_overlap"),
        ({"bf16": False}, "--overlap-moe-expert-parallel-comm", "only supported with bf16 or fp16"),
    ],
)
def test_moe_overlap_refuses_what_megatron_refuses(megatron: dict, flag: str, reason: str) -> None:
    err = error_of(make_args(["--pipeline-schedule", "1f1b"], **{**OVERLAP, **megatron}))
    assert err.flag == flag and "(megatron: " in str(err) and reason in str(err) and "\n" not in str(err)


@pytest.mark.parametrize("name", ["gpipe", "bfs"])
def test_moe_overlap_refuses_schedules_without_pairs(name: str) -> None:
    err = error_of(make_args(["--pipeline-schedule", name], **OVERLAP))
    assert err.flag == "--overlap-moe-expert-parallel-comm" and "nothing to overlap" in str(err)


def test_megatron_weight_gradient_delay_is_refused_with_a_schedule() -> None:
    err = error_of(make_args(["--pipeline-schedule", "zb-h1"], delay_wgrad_compute=True))
    assert err.flag == "--delay-wgrad-compute" and "--pipeline-schedule" in str(err) and "zb-h1" in str(err)
    validate_arguments(make_args([], delay_wgrad_compute=True))  # megatron's own schedule: megatron's business


@pytest.mark.parametrize(
    ("megatron", "flag"),
    [
        ({"moe_grouped_gemm": True}, "--moe-grouped-gemm"),
        ({"moe_use_legacy_grouped_gemm": True}, "--moe-use-legacy-grouped-gemm"),
        ({"moe_token_dispatcher_type": "flex"}, "--moe-token-dispatcher-type"),
        ({"moe_paged_stash": True}, "--moe-paged-stash"),
    ],
)
def test_cpu_mode_refuses_moe_options_that_need_a_gpu(megatron: dict, flag: str) -> None:
    err = error_of(make_args(["--cpu", "--pipeline-schedule", "zb-h1"], num_experts=2, **megatron))
    assert err.flag == flag and "--cpu" in str(err)
    validate_arguments(make_args(["--cpu"], num_experts=2, moe_token_dispatcher_type="alltoall"))


def test_cpu_flag_checks_cpu_settings() -> None:
    validate_arguments(make_args(["--cpu"]))
    err = error_of(make_args(["--cpu"], distributed_backend="nccl"))
    assert err.flag == "--cpu" and "--distributed-backend gloo" in str(err)


def test_memory_limit_and_costs_parsing() -> None:
    assert parse_pipeline_memory_limit("2p") == ActivationLimit(2.0, True)
    assert parse_pipeline_memory_limit("2P").resolve(4) == 8
    assert parse_pipeline_memory_limit("p").resolve(3) == 3
    assert parse_pipeline_memory_limit("12").resolve(4) == 12
    assert parse_pipeline_costs("1,2,1") == (1.0, 2.0, 1.0, 0.0)
    assert parse_pipeline_costs("1, 2, 1, 0.5") == (1.0, 2.0, 1.0, 0.5)
    for bad in ("", "x", "-1", "0", "2q"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"memory limit|expected"):
            parse_pipeline_memory_limit(bad)
    for bad in ("1,2", "1,2,3,4,5", "1,x,1", "1,0,1"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"expected|must"):
            parse_pipeline_costs(bad)


def test_schedule_file(tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "mine.csv"
    one_f_one_b(4, 8).save(path)
    config = validate_arguments(make_args(["--pipeline-schedule-file", str(path)]))
    assert config.build(4, 8).ops == one_f_one_b(4, 8).ops
    # rank count must match the pipeline
    err = error_of(make_args(["--pipeline-schedule-file", str(path)], pipeline_model_parallel_size=2))
    assert err.flag == "--pipeline-schedule-file" and "--pipeline-model-parallel-size 2" in str(err)
    # micro-batch count must match the run
    err = error_of(make_args(["--pipeline-schedule-file", str(path)], global_batch_size=16))
    assert err.flag == "--pipeline-schedule-file" and "16 per iteration" in str(err)
    # and evaluation must use the same count
    err = error_of(make_args(["--pipeline-schedule-file", str(path)], eval_iters=5, eval_global_batch_size=4))
    assert "--eval-iters 0" in str(err)


def test_schedule_file_that_cannot_run_is_refused(tmp_path: object) -> None:
    from pathlib import Path

    # rank 0 waits for the gradient of micro-batch 0 before sending its activation: deadlock / dependency error
    ops = [[BW(0, 0), F(0, 0)], [F(1, 0), BW(1, 0)]]
    path = Path(str(tmp_path)) / "bad.csv"
    build_schedule("bad", loop_placement(2), 1, ops).save(path)
    err = error_of(
        make_args(["--pipeline-schedule-file", str(path)], pipeline_model_parallel_size=2, global_batch_size=1)
    )
    assert err.flag == "--pipeline-schedule-file" and "bad.csv" in str(err)
    missing = Path(str(tmp_path)) / "missing.csv"
    assert error_of(make_args(["--pipeline-schedule-file", str(missing)])).flag == "--pipeline-schedule-file"


def test_errors_exit_like_argparse(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        validate_arguments_or_exit(make_args(["--pipeline-schedule", "1f1b"], num_layers=6), prog="pretrain_gpt.py")
    assert info.value.code == 2
    assert capsys.readouterr().err.startswith("pretrain_gpt.py: error: argument --num-layers: ")


def test_uneven_split_flags_under_v_placement_are_checked() -> None:
    from megatron_pp_ext.integration.features.layer_placement import layer_split_from_args
    from megatron_pp_ext.schedules.layer_split import LayerSplit, LayerSplitError, stage_layer_counts

    class Args:
        account_for_embedding_in_pipeline_split = True
        account_for_loss_in_pipeline_split = True
        decoder_first_pipeline_num_layers = None
        decoder_last_pipeline_num_layers = None

    split = layer_split_from_args(Args())
    assert split == LayerSplit(embedding=True, loss=True)
    assert stage_layer_counts(6, 4, split) == [1, 2, 2, 1]  # V at p=2: 4 model slices
    with pytest.raises(LayerSplitError, match="multiple of 4"):
        stage_layer_counts(7, 4, split)


def test_block_file_goes_to_v_block(tmp_path: Path) -> None:
    from megatron_pp_ext.schedules.generators.building_block import v_half_block

    block = tmp_path / "block.json"
    block.write_text(json.dumps(v_half_block(4).to_dict()))
    config = validate_arguments(make_args(["--pipeline-schedule", "v-block", "--pipeline-block-file", str(block)]))
    assert config.generator_kwargs(4)["block_file"] == str(block)
    assert config.build(4, 8).params["block_file"] == str(block)
    # a block laid out for another pipeline size, a file that is not there, a schedule without blocks
    flags = ["--pipeline-schedule", "v-block", "--pipeline-block-file", str(block)]
    err = error_of(make_args(flags, pipeline_model_parallel_size=2))
    assert err.flag == "--pipeline-block-file" and "lays out 4 ranks" in str(err)
    err = error_of(make_args(["--pipeline-schedule", "v-block", "--pipeline-block-file", str(tmp_path / "no.json")]))
    assert err.flag == "--pipeline-block-file" and "no.json" in str(err)
    err = error_of(make_args(["--pipeline-schedule", "v-zb", "--pipeline-block-file", str(block)]))
    assert err.flag == "--pipeline-block-file" and "block_file" in str(err)
    assert error_of(make_args(["--pipeline-block-file", str(block)])).flag == "--pipeline-block-file"


def test_pipeline_unit_size_for_zeropp() -> None:
    config = validate_arguments(make_args(["--pipeline-schedule", "zeropp", "--pipeline-unit-size", "4"]))
    assert config.unit_size == 4 and config.build(4, 8).params["unit_size"] == 4
    auto = validate_arguments(make_args(["--pipeline-schedule", "zeropp", "--pipeline-unit-size", "auto"]))
    assert auto.build(4, 8).params["unit_size_auto"] is True
    err = error_of(make_args(["--pipeline-schedule", "zeropp", "--pipeline-unit-size", "9"]))  # m = 8
    assert err.flag == "--pipeline-unit-size" and "1..m = 1..8" in str(err)
    err = error_of(make_args(["--pipeline-schedule", "1f1b", "--pipeline-unit-size", "2"]))
    assert err.flag == "--pipeline-unit-size"
    err = error_of(make_args(["--pipeline-unit-size", "2"]))
    assert err.flag == "--pipeline-unit-size" and "needs --pipeline-schedule" in str(err)
    with pytest.raises(SystemExit):
        make_args(["--pipeline-schedule", "zeropp", "--pipeline-unit-size", "0"])


def test_pipeline_post_validation_flag() -> None:
    config = validate_arguments(make_args(["--pipeline-schedule", "zb-h1", "--pipeline-post-validation"]))
    assert config.post_validation
    assert not validate_arguments(make_args(["--pipeline-schedule", "zb-h1"])).post_validation
    err = error_of(make_args(["--pipeline-post-validation"]))
    assert err.flag == "--pipeline-post-validation" and "needs --pipeline-schedule" in str(err)
    err = error_of(make_args(["--pipeline-schedule", "zb-h1", "--pipeline-fsdp", "--pipeline-post-validation"]))
    assert err.flag in ("--pipeline-post-validation", "--pipeline-fsdp")
    early = ["--pipeline-schedule", "zb-h1", "--pipeline-post-validation", "--pipeline-post-validation-early"]
    assert validate_arguments(make_args(early)).post_validation_early
    assert not config.post_validation_early  # late by default
    err = error_of(make_args(["--pipeline-schedule", "zb-h1", "--pipeline-post-validation-early"]))
    assert err.flag == "--pipeline-post-validation-early" and "goes with --pipeline-post-validation" in str(err)
