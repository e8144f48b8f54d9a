"""A hybrid layer pattern against the selected schedule, from the flags alone (no process group, no megatron
parse): one line naming --hybrid-layer-pattern and what would work, or the layer split the placement gets."""

from __future__ import annotations

import pytest

from megatron_pp_ext.integration.arguments import validate_arguments
from megatron_pp_ext.integration.argv_check import hybrid_pattern_problems
from megatron_pp_ext.integration.checkpoint_layout import table_from_args, table_of_layouts
from megatron_pp_ext.integration.config import PipelineArgumentError
from megatron_pp_ext.runtime.hybrid_pattern import hybrid_layer_split
from megatron_pp_ext.runtime.layer_map import chunk_layouts
from megatron_pp_ext.schedules.placement import v_placement
from tests.integration.megatron_args_helpers import make_args

P2 = {"pipeline_model_parallel_size": 2, "num_layers": 4}


def _refusal(schedule: str, pattern: str, **megatron) -> str:
    with pytest.raises(PipelineArgumentError) as info:
        validate_arguments(
            make_args(["--pipeline-schedule", schedule], hybrid_layer_pattern=pattern, **{**P2, **megatron})
        )
    text = str(info.value)
    assert text.startswith("argument --hybrid-layer-pattern: ") and "\n" not in text
    return text


def test_v_placement_needs_a_segment_per_stage() -> None:
    text = _refusal("v-zb", "*-|-*")
    assert "'*-|-*' has 2 segments; v-zb with p=2 needs 4 (2 per rank)" in text


def test_mamba_and_moe_bias_refused_on_cpu() -> None:
    assert "mamba_ssm" in _refusal("1f1b", "*M|-*", cpu=True)
    assert "--disable-bias-linear" in _refusal("1f1b", "*E|-*", cpu=True, add_bias_linear=True)


@pytest.mark.parametrize(
    ("schedule", "pattern", "counts"), [("v-zb", "*-|-*|*|-", (2, 2, 1, 1)), ("zb-h1", "*--|*", (3, 1))]
)
def test_fitting_pattern_gives_the_placements_split(schedule: str, pattern: str, counts: tuple[int, ...]) -> None:
    args = make_args(["--pipeline-schedule", schedule], hybrid_layer_pattern=pattern, **P2)
    config = validate_arguments(args)
    assert config.layer_split is not None and config.layer_split.counts == counts


def test_megatrons_own_assertions_become_one_line_before_parsing() -> None:
    base = ["--pipeline-model-parallel-size", "2", "--hybrid-layer-pattern"]
    assert hybrid_pattern_problems([*base, "*-|-*|*"]) == [
        "argument --hybrid-layer-pattern: '*-|-*|*' has 3 segments: megatron needs a multiple of "
        "--pipeline-model-parallel-size 2 (the segments are the pipeline stages, p x chunks per rank)"
    ]
    assert "unknown layer symbol(s) x" in hybrid_pattern_problems([*base, "*x|-*"])[0]
    assert hybrid_pattern_problems([*base, "*-|-*"]) == [] and hybrid_pattern_problems(["--num-layers", "4"]) == []


def test_checkpoint_layout_of_a_hybrid_run_follows_the_pattern() -> None:
    """A checkpoint's layer table (derived from its args) is the one the run built: the pattern's segments."""
    pattern = "*--|-|*|-*-"
    args = make_args(["--pipeline-schedule", "v-zb"], hybrid_layer_pattern=pattern, num_layers=8)
    args.pipeline_model_parallel_size, args.virtual_pipeline_model_parallel_size = 2, 2
    split = hybrid_layer_split(pattern, v_placement(2), "v-zb")
    expected = table_of_layouts([chunk_layouts(v_placement(2), 8, r, split) for r in range(2)])
    assert table_from_args(args) == expected
    args.hybrid_layer_pattern = None  # the same run without the pattern: an even split, another table
    assert table_from_args(args) not in (expected, None)
