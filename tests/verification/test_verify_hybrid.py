"""megatron-core's HybridModel under the schedule families: where the pattern's segments go, what is refused,
and (real ranks) losses and every gradient against the references and megatron's own 1F1B."""

from __future__ import annotations

import pytest

from megatron_pp_ext.cli.verify_command import hybrid_refusal
from megatron_pp_ext.runtime.hybrid_pattern import (
    HybridPatternError,
    check_runnable,
    chunk_layer_types,
    hybrid_layer_split,
    missing_mamba_kernels,
)
from megatron_pp_ext.runtime.layer_map import chunk_layouts
from megatron_pp_ext.schedules import generate
from megatron_pp_ext.schedules.placement import bidirectional_placement, loop_placement, v_placement
from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec
from megatron_pp_ext.verification.verify import verify_schedule

TWO_STAGES = "*-|-*"  # loop placements at p = 2
FOUR_STAGES = "*|E-|-|*"  # interleaved (v = 2), V-shape and bidirectional placements at p = 2


def _segments_by_stage(pattern: str, placement, name: str) -> dict[int, str]:
    split = hybrid_layer_split(pattern, placement, name)
    layers = len(pattern.replace("|", ""))
    found = {}
    for rank in range(placement.num_ranks):
        for layout in chunk_layouts(placement, layers, rank, split):
            found[layout.stage] = "".join(chunk_layer_types(pattern, layout))
    return found


@pytest.mark.slow  # imports megatron-core (seconds)
@pytest.mark.parametrize(("p", "v"), [(2, 1), (2, 2), (4, 2)])
def test_loop_placements_build_megatrons_segments(monkeypatch, p: int, v: int) -> None:
    """A loop placement's chunk builds what megatron's own select_pipeline_segment gives its rank and vp_stage."""
    from megatron_pp_ext.integration.cpu import enable_cpu_mode

    enable_cpu_mode()  # megatron's hybrid package imports triton kernels: the CPU stubs first
    import torch.distributed as dist
    from megatron.core.models.hybrid import hybrid_layer_allocation as allocation

    pattern = "|".join("*-E*"[: 1 + s % 4] for s in range(p * v))  # segments of different lengths
    placement = loop_placement(p, v)
    split = hybrid_layer_split(pattern, placement, "interleaved-1f1b")
    monkeypatch.setattr(dist, "get_rank", lambda group: group[0])
    monkeypatch.setattr(dist, "get_world_size", lambda group: group[1])
    for log in ("log_on_each_pipeline_stage", "log_single_rank"):  # these need a process group
        monkeypatch.setattr(allocation, log, lambda *args, **kwargs: None)
    for rank in range(p):
        for layout in chunk_layouts(placement, len(pattern.replace("|", "")), rank, split):
            megatron = allocation.select_pipeline_segment(pattern, (rank, p), layout.chunk if v > 1 else None)
            assert megatron == (chunk_layer_types(pattern, layout), layout.layer_offset)


@pytest.mark.parametrize("placement", [v_placement(2), bidirectional_placement(2)], ids=["v", "bidirectional"])
def test_v_and_bidirectional_stage_s_gets_segment_s(placement) -> None:
    segments = FOUR_STAGES.split("|")
    found = _segments_by_stage(FOUR_STAGES, placement, "v-zb")
    assert {s: found[s] for s in found} == {s: segments[placement.model_slice_of(s)] for s in found}
    if placement.num_replicas == 1:  # V: rank 0 holds the first and the last segment
        assert [found[s] for s in placement.stages_on_rank(0)] == [segments[0], segments[-1]]


@pytest.mark.parametrize(
    ("name", "p", "pattern", "line"),
    [
        ("v-zb", 2, "*-|*-|*-", "--hybrid-pattern '*-|*-|*-' has 3 segments; v-zb with p=2 needs 4 (2 per rank)"),
        ("1f1b", 2, "*-|*-|*-", "--hybrid-pattern '*-|*-|*-' has 3 segments; 1f1b with p=2 needs 2 (1 per rank)"),
        ("dualpipev", 2, "*-*-", "has no '|': dualpipev with p=2 runs 4 model stages (2 per rank); write the pattern"),
        ("1f1b", 2, "*-*", "3 layers do not split evenly over p=2 ranks"),
        ("1f1b", 2, "*-|*x", "unknown layer symbol(s) x"),
        ("1f1b", 2, "*-|*-/*", "verify builds its HybridModel without MTP ('/')"),
        ("1f1b", 2, "*-|*+", "'+' (multi-latent attention) cannot be built by verify"),
    ],
)
def test_refusals_are_one_line(name: str, p: int, pattern: str, line: str) -> None:
    refusal = hybrid_refusal(pattern, generate(name, p, 2 * p))
    assert refusal is not None and line in refusal and "\n" not in refusal


def test_pipe_free_pattern_splits_like_megatron_on_one_chunk_per_rank() -> None:
    assert hybrid_refusal("*-*-", generate("zb-h1", 2, 4)) is None
    assert hybrid_layer_split("*-*-", loop_placement(2), "zb-h1").counts == (2, 2)


@pytest.mark.skipif(not missing_mamba_kernels(), reason="the Mamba kernels import here")
def test_mamba_refused_without_its_kernels() -> None:
    with pytest.raises(HybridPatternError, match="mamba_ssm") as info:
        check_runnable("M*|-M", "*-E", "on CPU")
    assert "do not import here" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("name", "v", "pattern"),
    [
        ("1f1b", None, TWO_STAGES),
        ("zb-h1", None, TWO_STAGES),
        ("interleaved-1f1b", 2, FOUR_STAGES),
        ("v-zb", None, FOUR_STAGES),
        ("dualpipev", None, FOUR_STAGES),
        ("bitpipe", None, FOUR_STAGES),  # bidirectional: both copies of the model build the same segments
    ],
)
def test_hybrid_model_matches_references(pool, name: str, v: int | None, pattern: str) -> None:
    """Losses and every gradient within the derived verdict of the float64 and fp32 references (megatron's
    own schedule, unpartitioned); 1F1B also bit for bit equal to megatron's 1F1B on the same ranks."""
    schedule = generate(name, 2, 4, **({"v": v} if v else {}))
    report = verify_schedule(schedule, pool, model=TinyGPTSpec(hybrid_pattern=pattern), iterations=2)
    assert report.problems == []
    assert report.ok, report
    assert report.bitwise_megatron_1f1b is (True if name == "1f1b" else None)
