"""Per-layer-kind times from a per-stage profile (schedules/kind_profile.py): exact where the stages' layers
determine them, ``None`` where they do not, and the text ``--pipeline-costs`` reads back."""

from __future__ import annotations

import random

import pytest

from megatron_pp_ext.schedules.kind_profile import kind_times, layer_costs_text, stage_kind_counts, stage_times
from megatron_pp_ext.schedules.layer_split import LayerSplit
from megatron_pp_ext.schedules.placement import bidirectional_placement, loop_placement, v_placement
from megatron_pp_ext.schedules.values import parse_layer_costs

TRUE = {"dense": (1.0, 2.0, 1.0), "embedding": (0.5, 0.0, 0.5), "head": (3.0, 3.0, 2.5)}
HYBRID = {"mamba": (2.0, 4.0, 1.5), "attention": (1.5, 3.0, 1.0), "mlp": (1.0, 1.0, 1.0), **TRUE}


def _measured(counts: list, true: dict, noise: float = 0.0, seed: int = 0) -> list[tuple[float, ...]]:
    rng = random.Random(seed)
    return [
        tuple(sum(n * true[k][i] for k, n in c.items()) * (1 + rng.uniform(-noise, noise)) for i in range(3))
        for c in counts
    ]


def test_an_even_dense_split_over_three_or_more_stages_gives_every_kind() -> None:
    counts = stage_kind_counts(("dense",) * 8, loop_placement(4))
    assert [dict(c) for c in counts] == [
        {"dense": 2, "embedding": 1},
        {"dense": 2},
        {"dense": 2},
        {"dense": 2, "head": 1},
    ]
    fitted = kind_times(counts, _measured(counts, TRUE))
    assert fitted is not None and fitted.keys() == TRUE.keys()
    for kind, values in TRUE.items():
        assert fitted[kind] == pytest.approx(values, abs=1e-9)


def test_two_stages_do_not_determine_three_kinds() -> None:
    counts = stage_kind_counts(("dense",) * 8, loop_placement(2))
    assert kind_times(counts, _measured(counts, TRUE)) is None


def test_a_hybrid_pattern_under_v_and_bidirectional_placements() -> None:
    """Eight stages of mixed kinds (a V placement: rank 0 runs the first and the last); noise of 1% gives the
    kinds within a few per cent; both copies of a bidirectional model give the same rows."""
    pattern = "M-M*-|M-M-|*-MM|M*--|-M|M--*-|M*|-M-"
    kinds = tuple({"M": "mamba", "*": "attention", "-": "mlp"}[c] for c in pattern.replace("|", ""))
    split = LayerSplit(counts=tuple(len(s) for s in pattern.split("|")))
    for placement in (v_placement(4), bidirectional_placement(4)):
        counts = stage_kind_counts(kinds, placement, split)
        exact = kind_times(counts, _measured(counts, HYBRID))
        assert exact is not None
        for kind, values in exact.items():
            assert values == pytest.approx(HYBRID[kind], abs=1e-6)
    noisy = kind_times(counts, _measured(counts, HYBRID, noise=0.01))
    assert noisy is not None and noisy["mamba"] == pytest.approx(HYBRID["mamba"], rel=0.1)


def test_the_text_reads_back() -> None:
    seconds = {k: tuple(x * 1e-3 for x in v) for k, v in TRUE.items()}
    entries, micro_batch, tp = parse_layer_costs(layer_costs_text(seconds, 2, 4))
    assert (micro_batch, tp) == (2, 4)
    assert {k: pytest.approx(v) for k, v in entries.items()} == TRUE


def test_stage_times_sums_each_stage_and_kind_times_inverts_it() -> None:
    counts = stage_kind_counts(("dense",) * 8, v_placement(2))
    per_stage = stage_times(counts, TRUE)
    first = tuple(2 * d + e for d, e in zip(TRUE["dense"], TRUE["embedding"], strict=True))
    assert per_stage[0] == pytest.approx(first)
    fitted = kind_times(counts, per_stage)
    assert fitted is not None and all(fitted[k] == pytest.approx(TRUE[k]) for k in TRUE)


def test_stage_times_names_the_kinds_it_lacks() -> None:
    counts = stage_kind_counts(("dense",) * 4, loop_placement(2))
    with pytest.raises(ValueError, match=r"no times for layer kind\(s\) embedding, head"):
        stage_times(counts, {"dense": TRUE["dense"]})
