"""The planner: enumeration, filtering, ranking, extrapolation, speed, and the `plan` command."""

from __future__ import annotations

import csv
import io
import itertools
import json
from pathlib import Path

import pytest

from megatron_pp_ext.cli import main
from megatron_pp_ext.planner import Planner, SearchSpace, extrapolate
from megatron_pp_ext.planner.cost_model import DEVICES, CostModel, get_device, model_flops_per_iteration
from megatron_pp_ext.planner.megatron_args import config_args
from megatron_pp_ext.planner.memory import GIB, TrainingSetup
from megatron_pp_ext.planner.models import get_model
from megatron_pp_ext.planner.plan_report import row_label
from megatron_pp_ext.schedules import registry

FAST_SCHEDULES = tuple(n for n in ("1f1b", "gpipe", "interleaved-1f1b", "zb-h1", "zb-h2") if n in registry.names())


def _planner(model: str = "zb-6.2b", gpus: int = 8, batch: int = 96, **space: object) -> Planner:
    spec = get_model(model)
    cost = CostModel(spec, get_device("A100-80GB"), TrainingSetup())
    return Planner(spec, gpus, batch, cost, space=SearchSpace(**space))  # type: ignore[arg-type]


def test_device_presets_and_cost_model_shapes() -> None:
    for name in ("A100-80GB", "H100-80GB", "H200", "V100-32GB"):
        assert get_device(name).peak_tflops > 0
    assert {"a100-80gb", "h100-80gb", "h200", "v100-32gb"} <= set(DEVICES)
    model = get_model("zb-6.2b")
    cost = CostModel(model, get_device("A100-80GB"), TrainingSetup())
    lt = cost.layer_times(2, 1, "none")
    assert lt.b > lt.f > lt.w > 0  # B does the GEMMs again plus core attention twice
    assert cost.layer_times(2, 1, "full").b == pytest.approx(lt.b + lt.f)
    assert cost.layer_times(2, 1, "selective").b > lt.b
    assert cost.tp_comm_per_layer(2, 1) == (0.0, 0.0)
    assert cost.tp_comm_per_layer(2, 8)[0] > 0
    # p2p between nodes (pipeline spans > 8 GPUs) is slower than inside one
    assert cost.p2p_time(2, 1, 16, 1) > cost.p2p_time(2, 1, 8, 1)
    # bigger micro-batches run closer to peak (the papers' Table 7 / Fig. 12 trend)
    per_sample = [cost.layer_times(b, 1, "none").f / b for b in (1, 2, 4)]
    assert per_sample[0] > per_sample[1] > per_sample[2]
    # model FLOPs: 3x forward as megatron 0.19 counts them: 72 B s L h^2 (1 + s/12h + V/12Lh) for a
    # GPT (the Megatron-LM paper's formula with the causal mask halving core attention)
    b, s, layers, h, v = 96, 1024, 30, 4096, model.padded_vocab_size(1)
    reference = 72 * b * s * layers * h * h * (1 + s / (12 * h) + v / (12 * layers * h))
    assert model_flops_per_iteration(model, b) == pytest.approx(reference, rel=1e-6)


@pytest.mark.slow
def test_plan_zero_bubble_6_2b_on_8_gpus_lists_every_schedule_and_fits() -> None:
    planner = _planner()
    result = planner.run(progress=False)
    assert result.rows, "nothing fits"
    best = result.best_per_schedule()
    names = {row.config.schedule for row in best}
    for name in ("1f1b", "gpipe", "zb-h1"):
        if name in registry.names():
            assert name in names
    for row in result.rows:
        c = row.config
        assert c.tp * c.pp * c.dp == 8
        assert c.dp * c.micro_batch * c.num_microbatches == 96
        assert row.peak_memory <= planner.budget_bytes
        assert 0 < row.mfu < 1
    speeds = [r.samples_per_second for r in result.rows]
    assert speeds == sorted(speeds, reverse=True)
    # every schedule searched (all registered but v-block, which is v-half's block without a block file)
    # that never fits, or never applies, is explained
    for name in planner.schedule_names:
        if name not in names:
            assert name in result.inapplicable or any(k.startswith(name) for k in result.over_budget_best), name


def test_ranking_at_the_papers_shape_follows_the_simulated_bubble() -> None:
    """At the zero-bubble paper's 6.2B setting (8-stage pipeline, micro-batch 3, 32 micro-batches),
    schedules that run the same ops on the same loop placement differ only in their bubble: the
    ranking by estimated throughput is the ranking by (sync) bubble rate."""
    planner = _planner(tp=(1,), pp=(8,), micro_batch=(3,), recompute=("none",), virtual=(1,))
    result = planner.run(progress=False)
    rows = [r for r in result.rows if r.config.placement == "loop" and r.config.chunks == 1]
    assert len(rows) >= 2
    # one row per schedule and unit size (zeropp's U is an axis: its rows differ in their order too)
    by_speed = [row_label(r.config) for r in sorted(rows, key=lambda r: -r.samples_per_second)]
    by_bubble = [row_label(r.config) for r in sorted(rows, key=lambda r: r.sync_bubble_rate)]
    speeds = {row_label(r.config): r.samples_per_second for r in rows}
    assert len(speeds) == len(rows)
    for fast, slow in itertools.pairwise(by_bubble):
        assert speeds[fast] >= speeds[slow] * (1 - 1e-9), (by_speed, by_bubble)
    bubbles = {row_label(r.config): r.sync_bubble_rate for r in rows}
    if {"1f1b", "zb-h1"} <= set(bubbles):
        assert bubbles["zb-h1"] < bubbles["1f1b"]
        # 1F1B: (p-1)/(m+p-1) at equal F, B+W per stage; here stages differ a little (embedding-loss split)
        assert bubbles["1f1b"] == pytest.approx(7 / 39, rel=0.15)


def test_extrapolation_matches_exact_simulation(monkeypatch: pytest.MonkeyPatch) -> None:
    space = {"tp": (1,), "pp": (4,), "micro_batch": (1,), "recompute": ("none",), "schedules": FAST_SCHEDULES}
    extrapolated = {r.config.id: r for r in _planner("zb-1.5b", 4, 96, **space).run(progress=False).rows}
    assert any(r.extrapolated for r in extrapolated.values())  # m = 96 > 4p
    monkeypatch.setattr(extrapolate, "EXACT_MIN", 10**9)
    exact = {r.config.id: r for r in _planner("zb-1.5b", 4, 96, **space).run(progress=False).rows}
    assert set(exact) == set(extrapolated)
    for key, row in exact.items():
        assert not row.extrapolated
        other = extrapolated[key]
        assert other.iteration_time == pytest.approx(row.iteration_time, rel=1e-6), key
        assert other.peak_memory == pytest.approx(row.peak_memory, rel=1e-6), key
        assert other.sync_bubble_rate == pytest.approx(row.sync_bubble_rate, abs=1e-6), key


@pytest.mark.slow
def test_memory_budget_filters_and_explains() -> None:
    tight = _planner(schedules=FAST_SCHEDULES)
    tight.budget_bytes = 30 * GIB
    result = tight.run(progress=False)
    assert all(r.peak_memory <= 30 * GIB for r in result.rows)
    assert result.over_budget > 0 and result.over_budget_best


@pytest.mark.slow
def test_plan_searches_a_large_grid() -> None:
    """A 64-GPU search evaluates thousands of configurations. Its speed (configurations per CPU
    minute) is a benchmark figure in benchmarks/RESULTS.md ("Planner"), not a timed assert."""
    planner = _planner("zb-14.6b", 64, 512, schedules=FAST_SCHEDULES)
    result = planner.run(progress=False)
    assert result.evaluated >= 1000
    assert result.rows


def test_cli_plan_json_csv_and_save(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = ["plan", "--model", "tiny", "--device", "CPU", "--gpus", "2", "--global-batch", "8", "--no-cache"]
    common += ["--schedules", ",".join(FAST_SCHEDULES), "--no-progress"]
    assert main([*common, "--json", "--top", "3"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["format"] == "megatron-pp plan v1" and 0 < len(doc["rows"]) <= 3
    row = doc["rows"][0]
    assert "--pipeline-schedule" in row["megatron_args"] and row["peak_memory_gib"] > 0
    assert main([*common, "--csv", "--best-per-schedule"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    groups = {"pp=1" if r["pp"] == "1" else r["schedule"] + r["memory_limit"] for r in rows}  # pp=1: one group
    assert rows and len(groups) == len(rows)
    saved = tmp_path / "plan.json"
    assert main([*common, "--save", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "searched" in out and "samples/s" in out
    assert json.loads(saved.read_text())["rows"]
    assert main(["plan", "--list-models"]) == 0
    assert "zb-6.2b" in capsys.readouterr().out


def test_cli_plan_explicit_shapes_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--num-layers", "8", "--hidden-size", "512", "--num-attention-heads", "8", "--seq-length", "256"]
    args += ["--gpus", "4", "--global-batch", "16", "--schedules", "1f1b", "--no-progress", "--no-cache", "--top", "2"]
    assert main(args) == 0
    assert "custom" in capsys.readouterr().out
    assert main(["plan", "--num-layers", "8", "--gpus", "4", "--global-batch", "16", "--no-cache"]) == 2
    assert "--hidden-size" in capsys.readouterr().err


def test_without_a_pipeline_one_configuration_runs_megatrons_loop() -> None:
    """pp=1: every schedule is the same forward-backward loop, and chunks per rank only make megatron refuse
    the run ("When interleaved schedule is used, pipeline-model-parallel size should be greater than 1"):
    each (tp, dp, micro-batch, recompute) is listed once, as 1f1b with one chunk and no virtual-stage flag."""
    planner = _planner("zb-1.5b", 8, 144, tp=(1,), pp=(1, 2), micro_batch=(6,), recompute=("none",))
    result = planner.run(progress=False)
    flat = [r for r in result.rows if r.config.pp == 1]
    assert len(flat) == 1, [r.config.id for r in flat]
    (row,) = flat
    assert (row.config.schedule, row.config.chunks, row.config.memory_limit) == ("1f1b", 1, None)
    args = config_args(row.config, planner.setup, planner.global_batch)
    assert (
        "--num-virtual-stages-per-pipeline-rank" not in args and args[args.index("--pipeline-schedule") + 1] == "1f1b"
    )
    assert row_label(row.config) == "none (pp=1)"
    assert any(r.config.pp == 2 and r.config.chunks > 1 for r in result.rows)  # chunks still searched at pp > 1
    assert not any("p=1" in reason for reasons in result.inapplicable.values() for reason in reasons)
