"""``--pipeline-costs`` per layer kind (``KIND=F,B,W;...``, the text of ``plan --layer-costs``) and in a profile
file (its ``layer_costs`` key): one parser, one line on a bad value, and auto costing each stage from its layers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from megatron_args_helpers import TINY_SHAPE, make_args, make_parser

from megatron_pp_ext.integration.arguments import validate_arguments
from megatron_pp_ext.integration.auto_schedule import planner_for_run, resolve
from megatron_pp_ext.integration.config import LayerKindCosts, PipelineArgumentError
from megatron_pp_ext.schedules.costs import Costs
from megatron_pp_ext.schedules.placement import loop_placement
from megatron_pp_ext.schedules.values import parse_layer_costs

TINY = TINY_SHAPE
AUTO = ["--pipeline-schedule", "auto", "--cpu", "--pipeline-memory-budget", "4"]
KINDS = "dense=1,2,1;embedding=0.5,0,0.5;head=3,3,3;micro_batch=2"


def _profile(tmp_path: Path, **extra: object) -> str:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"t_f": [1.0, 1.5], "t_b": [2.0, 2.5], "t_w": [1.0, 1.0], "t_comm": 0.1, **extra}))
    return str(path)


def test_the_flag_reads_plan_layer_costs_text() -> None:
    config = validate_arguments(make_args([*AUTO, "--pipeline-costs", KINDS], **TINY))
    entries, micro_batch, tp = parse_layer_costs(KINDS)
    assert config.costs == LayerKindCosts(tuple(sorted(entries.items())), micro_batch, tp)


@pytest.mark.parametrize(
    "value, message",
    [
        ("dence=1,2,1", "unknown layer kind 'dence'"),
        ("dense=1,2", "dense: expected F,B,W finite numbers"),
        ("dense=1,2,1;tp=0", "tp must be an integer >= 1"),
    ],
)
def test_a_bad_value_is_one_argparse_line(value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        make_parser().parse_args(["--pipeline-costs", value])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert info.value.code == 2 and err.startswith("pretrain_gpt.py: error: argument --pipeline-costs: ")
    assert message in err


def test_a_profile_file_carries_them(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A profile's ``layer_costs``: auto reads them; a named cost-aware schedule is built with the profile's
    per-stage costs; a bad entry is one line naming the file and the key."""
    path = _profile(tmp_path, layer_costs=KINDS)
    auto = validate_arguments(make_args([*AUTO, "--pipeline-costs", path], **TINY))
    assert isinstance(auto.costs, LayerKindCosts) and dict(auto.costs.entries)["head"] == (3.0, 3.0, 3.0)
    named = validate_arguments(
        make_args(
            ["--pipeline-schedule", "zb-auto", "--pipeline-costs", path], **{**TINY, "pipeline_model_parallel_size": 2}
        )
    )
    built = named.generator_kwargs(2)["costs"]
    assert isinstance(built, Costs) and built.t_f == (1.0, 1.5) and built.t_comm == 0.1
    bad = _profile(tmp_path, layer_costs="dense=1,2,1;foo=1,1,1")
    with pytest.raises(SystemExit):
        make_parser().parse_args(["--pipeline-costs", bad])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"cost profile {bad!r}, its 'layer_costs': unknown layer kind 'foo'" in err


def test_what_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PipelineArgumentError, match=r"no times for layer kind\(s\) embedding, head .* give every kind"):
        validate_arguments(make_args(["--pipeline-schedule", "zb-auto", "--pipeline-costs", "dense=1,2,1"], **TINY))
    moe = make_args(["--pipeline-schedule", "zb-auto", "--pipeline-costs", KINDS], **{**TINY, "num_experts": 4})
    with pytest.raises(PipelineArgumentError, match="need every layer's kind"):
        validate_arguments(moe)
    with pytest.raises(PipelineArgumentError, match="this profile has per-stage costs only"):
        validate_arguments(make_args([*AUTO, "--pipeline-costs", _profile(tmp_path)], **TINY))


LAYOUT = "Et|ttt|ttt|tL"


def test_a_named_schedule_sums_each_stage_from_its_layers() -> None:
    """A named cost-aware schedule given per-kind costs is built with each stage's sum over its layers under the
    run's split (the embedding on the first model stage, the head on the last), scaled to the run's micro-batch."""
    loop = make_args(
        ["--pipeline-schedule", "zb-auto", "--pipeline-costs", KINDS],
        **{**TINY, "pipeline_model_parallel_size": 2, "decoder_first_pipeline_num_layers": 5},
    )
    built = validate_arguments(loop).generator_kwargs(2)["costs"]
    assert isinstance(built, Costs) and built.t_comm == 0.0
    # stage 0: 5 dense + embedding, stage 1: 3 dense + head (KINDS: dense 1,2,1; embedding .5,0,.5; head 3,3,3)
    assert (built.t_f, built.t_b, built.t_w) == ((5.5, 6.0), (10.0, 9.0), (5.5, 6.0))
    v = make_args(
        ["--pipeline-schedule", "v-zb", "--pipeline-costs", KINDS],
        **{**TINY, "pipeline_model_parallel_size": 2, "micro_batch_size": 4, "pipeline_model_parallel_layout": LAYOUT},
    )
    built = validate_arguments(v).generator_kwargs(2)["costs"]
    assert isinstance(built, Costs)
    # micro-batch 4 against the costs' 2: twice each kind; model stages 0-3 hold E+1, 3, 3, 1+L
    assert built.t_f == pytest.approx((2 * 1.5, 2 * 3.0, 2 * 3.0, 2 * 4.0))


def _stage_f_ms(args: object, split: tuple[int, ...], costs: str) -> list[float]:
    config = validate_arguments(args)
    planner = planner_for_run(args, budget_gib=4.0, stage_costs_ms=None, cpu=True, layer_costs=config.costs)
    placement = loop_placement(len(split))
    layout = planner.stage_layout(placement, split, 1, 2, "none")
    return [x * 1e3 for x in planner.stage_costs(layout, placement, 1, len(split), 1, 2, "none").t_f]


def test_auto_costs_each_stage_of_an_uneven_split_from_its_layers() -> None:
    """Megatron's 5-1-1-1 split: each stage's forward is its layers' plus the embedding (first) and head (last)."""
    args = make_args([*AUTO, "--pipeline-costs", KINDS], **{**TINY, "decoder_first_pipeline_num_layers": 5})
    assert _stage_f_ms(args, (5, 1, 1, 1), KINDS) == pytest.approx([5.5, 1.0, 1.0, 4.0])
    config = resolve(args, validate_arguments(args))
    assert config.schedule not in (None, "auto") and "pipeline schedule auto" in (config.auto_table or "")


def test_auto_costs_each_stage_of_a_hybrid_pattern_from_its_kinds() -> None:
    costs = "attention=2,4,2;mlp=1,2,1;embedding=0,0,0;head=0,0,0;micro_batch=2"
    pattern = "**-|---"
    args = make_args(
        [*AUTO, "--pipeline-costs", costs],
        **{**TINY, "num_layers": 6, "hybrid_layer_pattern": pattern, "pipeline_model_parallel_size": 2},
    )
    assert _stage_f_ms(args, (3, 3), costs) == pytest.approx([5.0, 3.0])


def test_the_profile_writer_adds_the_kinds_its_stages_determine(tmp_path: Path) -> None:
    """A 4-stage profile of the even dense split gives dense, embedding and head (written into the profile and
    read back by auto); a run whose kinds the profile cannot name writes none."""
    from megatron_pp_ext.integration.features.tracing import profile_layers as _profile_layers
    from megatron_pp_ext.runtime.replan import LAYER_COSTS_KEY, costs_to_json

    args = make_args(["--pipeline-schedule", "zb-auto"], **TINY)
    layers = _profile_layers(args, validate_arguments(args))
    assert layers is not None and layers.kinds == ("dense",) * 8 and (layers.micro_batch, layers.tp) == (2, 1)
    dense, embedding, head = (1e-3, 2e-3, 1e-3), (0.5e-3, 0.0, 0.5e-3), (3e-3, 3e-3, 2.5e-3)
    per_stage = [
        [2 * d + e * (s == 0) + h * (s == 3) for d, e, h in zip(dense, embedding, head, strict=True)] for s in range(4)
    ]
    measured = Costs(*(tuple(stage[i] for stage in per_stage) for i in range(3)), None, 1e-4)
    text = layers.text(measured, loop_placement(4))
    entries, micro_batch, _ = parse_layer_costs(text)
    assert entries["dense"] == pytest.approx((1.0, 2.0, 1.0)) and entries["head"] == pytest.approx((3.0, 3.0, 2.5))
    assert micro_batch == 2
    two = Costs(per_stage[0][:1] * 2, per_stage[0][1:2] * 2, per_stage[0][2:] * 2, None, 1e-4)
    assert layers.text(two, loop_placement(2)) is None  # two stages: two equations, three kinds
    path = tmp_path / "written.json"
    path.write_text(json.dumps({**costs_to_json(measured), LAYER_COSTS_KEY: text}))
    config = validate_arguments(make_args([*AUTO, "--pipeline-costs", str(path)], **TINY))
    assert isinstance(config.costs, LayerKindCosts) and dict(config.costs.entries)["embedding"] == pytest.approx(
        (0.5, 0.0, 0.5)
    )
    moe = make_args(["--pipeline-schedule", "zb-auto"], **{**TINY, "num_experts": 4})
    assert _profile_layers(moe, validate_arguments(moe)) is None
