"""The executor on a V placement: local hand-off at the turn, both directions per peer, tied embeddings on rank 0."""

from __future__ import annotations

import pytest

from megatron_pp_ext.schedules import BW, F, build_schedule, generate, names, v_placement
from megatron_pp_ext.schedules.layer_split import LayerSplit, stage_layer_counts
from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec
from megatron_pp_ext.verification.verify import verify_schedule


def gpipe_on_v(p: int, m: int):
    """All forwards down and back up the V, then all backwards: the simplest valid V schedule."""
    rows = []
    for r in range(p):
        down, up = r, 2 * p - 1 - r
        rows.append(
            [F(down, i) for i in range(m)]
            + [F(up, i) for i in range(m)]
            + [BW(up, i) for i in range(m)]
            + [BW(down, i) for i in range(m)]
        )
    return build_schedule("gpipe-v", v_placement(p), m, rows)


@pytest.mark.parametrize(("p", "m", "tied"), [(2, 3, True), (2, 2, False), (4, 5, True)])
def test_v_placement_matches_reference(pool, p, m, tied):
    schedule = gpipe_on_v(p, m)
    model = TinyGPTSpec(num_layers=2 * p, tied_embeddings=tied)
    report = verify_schedule(schedule, pool, model=model, iterations=3)
    assert report.problems == []
    assert report.ok, report


@pytest.mark.parametrize(
    "split",
    [LayerSplit(embedding=True, loss=True), LayerSplit(first=1, last=3)],
    ids=["embedding-and-loss-count-as-layers", "first-1-last-3"],
)
def test_uneven_stages_under_v_placement(pool, split):
    """Megatron's uneven first/last stage options, applied to the V placement's model slices."""
    if "v-half" not in names():
        pytest.skip("v-half is not registered")
    num_layers = 6 if split.embedding else 10
    counts = stage_layer_counts(num_layers, 4, split)
    assert counts[0] != counts[1] or counts[-1] != counts[1]  # really uneven
    schedule = generate("v-half", 2, 4)
    report = verify_schedule(schedule, pool, model=TinyGPTSpec(num_layers=num_layers, split=split), iterations=2)
    assert report.problems == []
    assert report.ok, report
