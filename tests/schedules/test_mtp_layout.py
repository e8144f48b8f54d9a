"""Multi-token prediction in layout strings (``m``) and hybrid patterns (``/``): what each placement accepts, and
the one-line refusals quoting megatron's placement rules (pure: no torch, no megatron)."""

from __future__ import annotations

import pytest

from megatron_pp_ext.runtime.hybrid_pattern import (
    HybridPatternError,
    chunk_layer_types,
    hybrid_layer_split,
    num_pattern_layers,
    pattern_segments,
    split_mtp,
)
from megatron_pp_ext.runtime.layer_map import chunk_layouts
from megatron_pp_ext.schedules.layer_split import (
    LayerSplit,
    LayerSplitError,
    check_mtp_layers,
    mtp_layout_problem,
    stage_layer_counts,
)
from megatron_pp_ext.schedules.placement import bidirectional_placement, loop_placement, v_placement
from megatron_pp_ext.schedules.values import parse_layer_layout


@pytest.mark.parametrize("layout", ["Et|t|t|tmL", "Ett|t|t|tmmL", "Et|t|t|(t)*2,mL"])
def test_mtp_with_the_loss_maps_like_plain_layers(layout: str) -> None:
    stages = parse_layer_layout(layout)
    counts = stage_layer_counts(sum(s.count("t") for s in stages), 4, LayerSplit.from_layout(layout))
    assert counts == [s.count("t") for s in stages]  # the m are no transformer layers of the split
    check_mtp_layers(stages, "".join(stages).count("m"))


@pytest.mark.parametrize(
    ("layout", "mtp", "words"),
    [
        ("Et|t|tm|tL", 1, "megatron places multi-token prediction layers (m) after every transformer layer (t)"),
        ("Et|tm|t|mL", 2, "megatron places multi-token prediction layers (m) after every transformer layer (t)"),
        ("Etm|L", 1, "megatron never puts multi-token prediction layers (m) on the first stage"),
        ("Et|t|tm|L", 1, "the multi-token prediction layers (m) sit in the stage with the loss"),
        ("Et|t|t|tmL", None, "holds 1 multi-token prediction layer(s) (m), --mtp-num-layers is 0"),
        ("Et|t|t|tL", 1, "holds 0 multi-token prediction layer(s) (m), --mtp-num-layers is 1"),
    ],
)  # fmt: skip
def test_mtp_layouts_breaking_a_rule_are_refused_in_one_line(layout: str, mtp: int | None, words: str) -> None:
    with pytest.raises(LayerSplitError) as info:
        check_mtp_layers(parse_layer_layout(layout), mtp)
    assert words in str(info.value) and "\n" not in str(info.value)


def test_the_placement_split_refuses_an_mtp_stage_before_the_loss() -> None:
    with pytest.raises(LayerSplitError, match="stage with the loss"):
        stage_layer_counts(3, 4, LayerSplit.from_layout("Et|t|tm|L"))
    assert mtp_layout_problem(("Et", "tL")) is None


@pytest.mark.parametrize("pattern", ["*-|-*/*-", "*-|-*/*-/*-"])
def test_hybrid_mtp_part_is_no_segment(pattern: str) -> None:
    main, mtp, depths = split_mtp(pattern)
    assert (main, mtp, depths) == ("*-|-*", "*-", pattern.count("/"))
    assert pattern_segments(pattern) == ("*-", "-*")
    assert num_pattern_layers(pattern) == 4
    split = hybrid_layer_split(pattern, loop_placement(2), "1f1b")
    assert split.counts == (2, 2)
    last = chunk_layouts(loop_placement(2), 4, 1, split)[0]
    assert chunk_layer_types(pattern, last) == ["-", "*"]  # the decoder's layers only


@pytest.mark.parametrize("placement", [v_placement(2), bidirectional_placement(2)])
def test_hybrid_mtp_under_v_and_bidirectional_needs_the_placements_segments(placement) -> None:
    split = hybrid_layer_split("*-|-*|*-|-*/*-", placement, "v-zb")
    assert split.counts == (2, 2, 2, 2)
    with pytest.raises(HybridPatternError, match="has 2 segments"):
        hybrid_layer_split("*-|-*/*-", placement, "v-zb")


@pytest.mark.parametrize(
    ("pattern", "words"),
    [
        ("*-|-*/*-/-*", "one identical MTP pattern per prediction depth"),
        ("*-|-*/*|-", "MTP pattern (after '/') takes no '|'"),
        ("*-|-*/*x", "unknown layer symbol(s) x"),
    ],
)
def test_hybrid_mtp_parts_megatron_refuses_are_refused_in_one_line(pattern: str, words: str) -> None:
    with pytest.raises(HybridPatternError) as info:
        pattern_segments(pattern)
    assert words in str(info.value) and "\n" not in str(info.value)
