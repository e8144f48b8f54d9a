"""The arithmetic of a layout run against its prediction (planner/layout_runs.py): predicted busy time per
rank, the tracer summaries read back and the gains."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from megatron_pp_ext.planner.cost_model import LayerTimes
from megatron_pp_ext.planner.layer_costs import LayerCostTable
from megatron_pp_ext.planner.layout_runs import (
    agreement,
    gain,
    predicted_busy,
    read_trace,
)
from megatron_pp_ext.schedules.placement import loop_placement, v_placement

EMBED = LayerTimes(0.5, 0.0, 0.25)
LAYER = LayerTimes(1.0, 2.0, 1.5)
HEAD = LayerTimes(3.0, 5.0, 4.0)
TABLE = LayerCostTable(EMBED, (LAYER,) * 8, HEAD)


def total(x: LayerTimes) -> float:
    return x.f + x.b + x.w


def test_predicted_busy_loop_counts_each_rank_slice_times_microbatches() -> None:
    m = 3
    busy = predicted_busy(TABLE, loop_placement(2), (6, 2), m)
    assert busy == pytest.approx([m * (total(EMBED) + 6 * total(LAYER)), m * (2 * total(LAYER) + total(HEAD))])


def test_predicted_busy_v_puts_embedding_and_head_on_rank_0() -> None:
    m = 4
    busy = predicted_busy(TABLE, v_placement(2), (1, 3, 3, 1), m)
    rank0 = total(EMBED) + 1 * total(LAYER) + 1 * total(LAYER) + total(HEAD)  # stages 0 and 3
    rank1 = 6 * total(LAYER)  # stages 1 and 2
    assert busy == pytest.approx([m * rank0, m * rank1])
    assert sum(busy) == pytest.approx(m * (total(EMBED) + 8 * total(LAYER) + total(HEAD)))


def test_predicted_busy_refuses_a_split_of_other_layers() -> None:
    with pytest.raises(ValueError, match="layers"):
        predicted_busy(TABLE, loop_placement(2), (4, 3), 1)


def write_summaries(directory: Path, per_rank: list[list[tuple[float, float]]]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for rank, iterations in enumerate(per_rank):
        doc = {"per_iteration": [{"busy_s": busy, "step_time_s": step} for busy, step in iterations]}
        (directory / f"summary_rank{rank}.json").write_text(json.dumps(doc))


def test_read_trace_medians_after_the_warmup(tmp_path: Path) -> None:
    rank0 = [(9.0, 99.0), (1.0, 2.0), (3.0, 4.0), (2.0, 3.0)]
    rank1 = [(9.0, 99.0), (5.0, 2.5), (7.0, 3.5), (6.0, 5.0)]
    write_summaries(tmp_path, [rank0, rank1])
    run = read_trace(tmp_path, 2, skip=1)
    assert run.iterations == 3
    assert run.busy == (2.0, 6.0)
    # per iteration the slowest rank's step: 2.5, 4.0, 5.0; the warm-up's 99 is dropped
    assert run.step == 4.0


def test_read_trace_names_the_missing_file_and_a_run_without_timed_iterations(tmp_path: Path) -> None:
    write_summaries(tmp_path, [[(1.0, 1.0), (1.0, 1.0)]])
    with pytest.raises(ValueError, match=r"summary_rank1\.json"):
        read_trace(tmp_path, 2, skip=0)
    with pytest.raises(ValueError, match="no iteration after the first 2"):
        read_trace(tmp_path, 1, skip=2)


def test_gain_and_agreement() -> None:
    assert gain(100.0, 80.0) == pytest.approx(0.2)
    assert gain(100.0, 110.0) == pytest.approx(-0.1)
    with pytest.raises(ValueError, match="> 0"):
        gain(0.0, 1.0)
    assert agreement(0.18, 0.2) == pytest.approx(0.9)
    assert math.isnan(agreement(0.1, 0.0))
