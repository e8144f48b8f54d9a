"""Uneven pipeline stages on real gloo ranks: a loop, a V and a bidirectional schedule on megatron's uneven-split
flags (mapped onto each placement's model stages) match the unpartitioned reference, and megatron's own 1F1B on
the same flags (bit for bit with ours, and within float rounding of the other schedules' losses)."""

from __future__ import annotations

import math

import pytest

from megatron_pp_ext.schedules import generate
from megatron_pp_ext.schedules.layer_split import LayerSplit, stage_layer_counts
from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec
from megatron_pp_ext.verification.verify import verify_schedule

P, M, LAYERS, ITERATIONS = 2, 4, 7, 2
FIRST = LayerSplit(first=1)  # p = 2: loop [1, 6]; V / bidirectional (4 model stages) [1, 2, 2, 2]
LAYOUT = LayerSplit.from_layout("Et|ttt|t|ttL")  # 4 model stages [1, 3, 1, 2]
_LOSSES: dict[str, list[float]] = {}


def _verify(pool, name: str, split: LayerSplit):
    schedule = generate(name, P, M)
    counts = stage_layer_counts(LAYERS, schedule.placement.stages_per_replica, split)
    assert len(set(counts)) > 1  # really uneven
    model = TinyGPTSpec(num_layers=LAYERS, split=split)
    report = verify_schedule(schedule, pool, model=model, iterations=ITERATIONS)
    assert report.problems == []
    assert report.ok, report
    return report


def test_megatron_1f1b_on_the_uneven_split(pool) -> None:
    report = _verify(pool, "1f1b", FIRST)
    assert report.bitwise_megatron_1f1b is True  # ours and megatron's own 1F1B, same flags, same layers
    _LOSSES["1f1b"] = report.losses


@pytest.mark.parametrize("name", ["zb-h1", "v-zb"])
def test_split_schedules_on_the_uneven_split(pool, name: str) -> None:
    report = _verify(pool, name, FIRST)
    if "1f1b" not in _LOSSES:
        pytest.skip("needs test_megatron_1f1b_on_the_uneven_split first")
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(report.losses, _LOSSES["1f1b"], strict=True))


def test_bidirectional_placement_on_a_layout_string(pool) -> None:
    _verify(pool, "bitpipe", LAYOUT)  # both replicas hold the layout's stages


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--num-layers", "5", "--decoder-first-pipeline-num-layers", "1"],
         ["argument --decoder-first-pipeline-num-layers:", "v-zb: v placement", "--num-layers 7"]),
        (["--pipeline-model-parallel-layout", "Et|tL"], ["argument --pipeline-model-parallel-layout:", "4 model"]),
        (["--pipeline-model-parallel-layout", "Et|tt|tx|tL"], ["argument --pipeline-model-parallel-layout:", "'x'"]),
    ],
)  # fmt: skip
def test_verify_refuses_a_split_without_mapping_in_one_line(capsys: pytest.CaptureFixture[str], flags, words) -> None:
    from megatron_pp_ext.cli.main import main

    assert main(["verify", "v-zb", "-p", "2", "-m", "4", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    for word in words:
        assert word in err, err
