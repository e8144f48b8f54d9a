"""``--pipeline-schedule auto`` with a hybrid layer pattern: the pattern's ``|`` segments are the run's stage split,
kept as auto keeps an uneven split (integration/auto_schedule.py), and each stage costs its layers' kinds."""

from __future__ import annotations

import pytest
from megatron_args_helpers import TINY_SHAPE, make_args

from megatron_pp_ext.integration.arguments import validate_arguments
from megatron_pp_ext.integration.auto_schedule import planner_for_run, resolve, run_layer_split
from megatron_pp_ext.integration.config import PipelineArgumentError
from megatron_pp_ext.planner.auto import decide
from megatron_pp_ext.schedules.layer_split import LayerSplit

# at 2 ranks; the layer count comes from each test's pattern
TINY = {**{k: v for k, v in TINY_SHAPE.items() if k != "num_layers"}, "pipeline_model_parallel_size": 2}
AUTO = ["--pipeline-schedule", "auto", "--cpu", "--pipeline-memory-budget", "4"]


def _args(pattern: str) -> object:
    """megatron's args for ``pattern`` as its validation leaves them: the layer count and the virtual pipeline
    size derived from the pattern (segments / p when more segments than ranks)."""
    segments = pattern.count("|") + 1
    vp = segments // 2 if segments > 2 else None
    layers = len(pattern.replace("|", ""))
    derived = {"hybrid_layer_pattern": pattern, "num_layers": layers, "virtual_pipeline_model_parallel_size": vp}
    return make_args(AUTO, **{**TINY, **derived})


def _one_f_one_b(pattern: str) -> object:
    return decide(planner_for_run(_args(pattern), budget_gib=4.0, stage_costs_ms=None, cpu=True), ("1f1b",)).chosen


def test_the_segments_are_the_split_auto_plans_with() -> None:
    """The 1f1b row of each pattern has the pattern's split; the even one is fastest (it was ignored: every
    pattern planned the even split)."""
    even, heavy_first, heavy_last = (_one_f_one_b(p) for p in ("*-*-|*-*-", "*-*-*-|*-", "*-|*-*-*-"))
    assert (even.config.split, heavy_first.config.split, heavy_last.config.split) == ((4, 4), (6, 2), (2, 6))
    assert even.iteration_time < min(heavy_first.iteration_time, heavy_last.iteration_time)


def test_each_stage_costs_its_layer_kinds() -> None:
    """Same split, different kinds: attention layers cost more than MLP layers here, so the pattern that puts
    them on one stage is slower than the one that spreads them; megatron's other mixers take the nearest kind."""
    spread, packed = _one_f_one_b("*-*-|*-*-"), _one_f_one_b("****|----")
    assert spread.config.split == packed.config.split == (4, 4)
    assert spread.iteration_time < packed.iteration_time
    planner = planner_for_run(_args("M*D+|G-E-"), budget_gib=4.0, stage_costs_ms=None, cpu=True)
    assert planner.model.hybrid_pattern == "M***M-E-" and planner.model.num_experts


def test_auto_picks_a_placement_of_the_segment_count(capsys: pytest.CaptureFixture[str]) -> None:
    """Four segments at p = 2: only placements of four model stages apply (V, bidirectional, interleaved with
    2 chunks); the choice passes the run's own pattern check and builds the chunks its placement has."""
    args = _args("*-|-*|*-|-*")
    config = resolve(args, validate_arguments(args))
    schedule = config.build(2, 8)
    assert schedule.placement.stages_per_replica == 4
    assert args.pipeline_layer_split == LayerSplit(counts=(2, 2, 2, 2))
    assert args.virtual_pipeline_model_parallel_size == schedule.chunks_per_rank
    assert "dropped 1f1b: not applicable" in (config.auto_table or "")
    capsys.readouterr()


def test_a_pattern_that_splits_neither_way_is_one_line() -> None:
    with pytest.raises(PipelineArgumentError, match=r"^argument --hybrid-layer-pattern: .*do not split evenly"):
        run_layer_split(_args("*-*-*"))
    assert run_layer_split(_args("*-*-")) == LayerSplit(counts=(2, 2))  # no '|': megatron's even split
