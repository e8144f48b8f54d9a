"""``--pipeline-schedule auto`` in real training runs (scripts/pretrain_gpt.py, 4 CPU ranks over gloo).

* ``--pipeline-replan``: after one profiled iteration, auto decides again from the measured costs. The log
  line must carry the measured profile (the one ``--pipeline-profile-out`` writes), and its choice and time
  must be what the planner gives for those costs (recomputed here from the written profile).
* The switch: at 10 micro-batches (bitpipe excluded) auto starts with dualpipev; the test hook
  ``MEGATRON_PP_TEST_SCALE_MEASURED=b=4`` makes the measured profile backward-heavy, where the planner ranks
  another V schedule (v-zb) first by a few per cent. The run must log the switch, its executor must run the new
  schedule's op order on every rank from the iteration after the profiled one (the trace), and its losses must
  fall and match a run that keeps dualpipev (dropout off: only the op order differs).
* Memory: with a budget between the memory model's zb-h1 and zb-h2 peaks (excluding the 2p schedules), the
  MEASURED peak of auto's pick (parameters and gradient buffers as allocated, Adam's moments by accounting,
  plus the tracer's peak of live activation bytes) is within the budget, and zb-h2's measured peak is not.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from megatron_args_helpers import TINY_SHAPE, make_args
from warm_launch import launch, run_env

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "pretrain_gpt.py"
# FLAGS' run as megatron parses it: the tiny shape, megatron's default dropouts (FLAGS set none), 4 stages
SHAPE = {**TINY_SHAPE, "hidden_dropout": 0.1, "attention_dropout": 0.1, "pipeline_model_parallel_size": 4}
FLAGS = [
    "--cpu", "--pipeline-model-parallel-size", "4",
    "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "2", "--global-batch-size", "16", "--lr", "1e-3",
    "--eval-interval", "1000", "--eval-iters", "0", "--log-interval", "1", "--num-workers", "0",
]  # fmt: skip
ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+) .*lm loss: ([0-9.E+-]+)")
CHOICE = re.compile(r"pipeline schedule auto: (\S+) \(v=(\d+), (\w+) placement\): iteration (\S+) ms")


def _launch(tmp: Path, name: str, extra: list[str], env_extra: dict[str, str] | None = None) -> tuple[Any, Path]:
    return launch(tmp, name, [*FLAGS, *extra], nproc=4, env=run_env(**(env_extra or {})))


def _finish(proc: Any, log: Path, iterations: int) -> str:
    try:
        proc.wait(timeout=900)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    text = log.read_text()
    assert proc.returncode == 0, text[-4000:]
    done = [int(m.group(1)) for m in ITERATION.finditer(text)]
    assert done == list(range(1, iterations + 1)), text[-4000:]
    return text


@pytest.mark.gloo
def test_replan_redecides_from_the_measured_profile(tmp_path: Path) -> None:
    from megatron_pp_ext.integration.auto_schedule import planner_for_run
    from megatron_pp_ext.planner.auto import decide
    from megatron_pp_ext.runtime.replan import load_costs
    from megatron_pp_ext.schedules import registry
    from megatron_pp_ext.schedules.placement import make_placement

    profile = tmp_path / "profile.json"
    extra = ["--pipeline-schedule", "auto", "--pipeline-memory-budget", "4", "--pipeline-replan"]
    extra += ["--pipeline-profile-iters", "1", "--train-iters", "3", "--pipeline-profile-out", str(profile)]
    text = _finish(*_launch(tmp_path, "replan", extra), iterations=3)

    first, again = CHOICE.findall(text)[:2]  # the start-up decision, then the re-decision
    name, v, style = first[0].split("@")[0], int(first[1]), first[2]
    line = next(x for x in text.splitlines() if "auto re-decided from the measured profile" in x)
    # the stage costs the re-decision used, from the profile every rank agreed on
    costs = load_costs(profile)
    placement = make_placement(style, 4, v)
    replicas = placement.num_stages // placement.stages_per_replica
    f, b, w, _ = costs.per_stage(placement.num_stages)
    stage_ms = tuple(sum(x) / replicas / 4 * 1e3 for x in (f, b, w))
    assert f"F {stage_ms[0]:.4g} ms, B {stage_ms[1]:.4g} ms, W {stage_ms[2]:.4g} ms" in line, line
    assert f"among {style} schedules with {v} chunk(s) per rank" in line
    assert ("keeping " + first[0]) in line or "switching " in line
    # and what the planner decides for those costs (same placement) is what the run logged
    args = make_args(
        ["--pipeline-schedule", "auto", "--cpu"], **SHAPE, virtual_pipeline_model_parallel_size=v if v > 1 else None
    )
    planner = planner_for_run(args, budget_gib=4.0, stage_costs_ms=stage_ms, cpu=True)  # type: ignore[arg-type]
    if style == "loop":
        from dataclasses import replace

        planner.space = replace(planner.space, virtual=(v,))
    names = tuple(n for n in registry.names() if n != "v-block" and registry.get(n).placement == style)
    decision = decide(planner, names)
    assert decision.chosen is not None
    label = decision.chosen.config.schedule + (
        f"@{decision.chosen.config.memory_limit}" if decision.chosen.config.memory_limit else ""
    )
    assert again[0] == label and again[3] == f"{decision.chosen.iteration_time * 1e3:.3g}", (again, label)
    assert f"re-planned '{label.split('@')[0]}' from a profile of 1 iteration(s)" in text
    assert name in registry.names()
    # 8 dense layers on 4 ranks: the stages determine dense, embedding and head, which the profile carries
    import json

    from megatron_pp_ext.runtime.replan import LAYER_COSTS_KEY
    from megatron_pp_ext.schedules.values import parse_layer_costs

    entries, micro_batch, tp = parse_layer_costs(json.loads(profile.read_text())[LAYER_COSTS_KEY])
    assert set(entries) == {"dense", "embedding", "head"} and (micro_batch, tp) == (SHAPE["micro_batch_size"], 1)


SWITCH = re.compile(r"auto re-decided from the measured profile .*: switching (\S+) -> (\S+)")
M10 = ["--global-batch-size", "20", "--hidden-dropout", "0", "--attention-dropout", "0"]  # 10 micro-batches


@pytest.mark.gloo
def test_replan_switches_and_the_run_trains_with_the_new_schedule(tmp_path: Path) -> None:
    from dataclasses import replace

    from megatron_pp_ext.integration.auto_schedule import planner_for_run
    from megatron_pp_ext.integration.config import PipelineConfig, parse_pipeline_memory_limit
    from megatron_pp_ext.planner.auto import decide
    from megatron_pp_ext.runtime.replan import TEST_SCALE_ENV, load_costs
    from megatron_pp_ext.schedules import registry

    iterations, profile, trace = 4, tmp_path / "profile.json", tmp_path / "trace"
    extra = [*M10, "--pipeline-schedule", "auto", "--pipeline-memory-budget", "4", "--pipeline-replan"]
    extra += ["--pipeline-profile-iters", "1", "--train-iters", str(iterations)]
    extra += ["--pipeline-profile-out", str(profile), "--pipeline-trace", str(trace)]
    auto = _launch(tmp_path, "switch", extra, {TEST_SCALE_ENV: "b=4"})
    keep = _launch(tmp_path, "keep", [*M10, "--pipeline-schedule", "dualpipev", "--train-iters", str(iterations)])
    text = _finish(*auto, iterations=iterations)
    reference = _finish(*keep, iterations=iterations)

    first = CHOICE.search(text)
    assert first is not None and first.group(1) == "dualpipev", text[-3000:]
    assert f"{TEST_SCALE_ENV}=b=4 scaled the measured profile" in text
    switch = SWITCH.search(text)
    assert switch is not None, text[-4000:]
    before, after = switch.groups()
    name, _, limit = after.partition("@")
    assert before == "dualpipev" and name != "dualpipev", switch.group(0)
    # the planner, given the profile the ranks agreed on (scaled, as written), ranks `after` first
    costs = load_costs(profile)
    f, b, w, _ = costs.per_stage(8)
    stage_ms = tuple(sum(x) / 4 * 1e3 for x in (f, b, w))  # V placement: 8 stages, one replica, p = 4
    args = make_args(["--pipeline-schedule", "auto", "--cpu"], **{**SHAPE, "global_batch_size": 20})
    names = tuple(n for n in registry.names() if registry.get(n).placement == "v" and n != "v-block")
    chosen = decide(planner_for_run(args, budget_gib=4.0, stage_costs_ms=stage_ms, cpu=True), names).chosen  # type: ignore[arg-type]
    assert chosen is not None and chosen.config.schedule == name
    assert (chosen.config.memory_limit or "") == limit
    # the executor ran dualpipev in the profiled iteration and the new schedule (built with the profile's
    # costs) op for op on every rank afterwards
    running = PipelineConfig(schedule="dualpipev").build(4, 10)
    switched = replace(
        PipelineConfig(schedule=name, costs=costs), memory_limit=parse_pipeline_memory_limit(limit) if limit else None
    ).build(4, 10)
    assert switched.name == name and switched.ops != running.ops
    for rank in range(4):
        summary = json.loads((trace / f"summary_rank{rank}.json").read_text())
        ran = [it["schedule"] for it in summary["per_iteration"]]
        assert ran == ["dualpipev"] + [name] * (iterations - 1), (rank, ran)
        assert [op[0] for op in summary["last_iteration_ops"]] == [str(op) for op in switched.ops[rank]], rank
    # it trains: the loss falls, and matches the run that kept dualpipev (only the order of ops differs)
    losses = [float(x[2]) for x in ITERATION.findall(text)]
    kept = [float(x[2]) for x in ITERATION.findall(reference)]
    print(f"losses after the switch to {after}: {losses}; dualpipev throughout: {kept}")
    assert losses[-1] < losses[0]
    assert losses[0] == kept[0]  # the profiled iteration ran the same schedule
    assert losses == pytest.approx(kept, rel=1e-5)


def _worst_peak(trace_dir: Path) -> int:
    summaries = sorted(trace_dir.rglob("summary_rank*.json"))
    assert len(summaries) == 4, summaries
    peaks = [json.loads(p.read_text())["peak_bytes"] for p in summaries]
    assert all(isinstance(x, int) and x > 0 for x in peaks), peaks
    return max(peaks)


@pytest.mark.gloo
def test_auto_never_picks_a_schedule_whose_measured_peak_exceeds_the_budget(tmp_path: Path) -> None:
    from megatron_pp_ext.integration.auto_schedule import planner_for_run
    from megatron_pp_ext.planner.auto import decide

    generous = make_args(["--pipeline-schedule", "auto", "--cpu"], **SHAPE)
    rows = decide(planner_for_run(generous, budget_gib=4.0, stage_costs_ms=None, cpu=True)).result.rows
    model_peak = {r.config.schedule + (f"@{r.config.memory_limit}" if r.config.memory_limit else ""): r for r in rows}
    low, high = model_peak["zb-h1"].peak_memory, model_peak["zb-h2"].peak_memory
    budget = (low + high) / 2  # bytes: the memory model fits zb-h1, not zb-h2 (nor the other 2p schedules)
    gib = f"{budget / 2**30!r}"
    auto, auto_log = _launch(
        tmp_path,
        "auto",
        [
            "--pipeline-schedule",
            "auto",
            "--pipeline-memory-budget",
            gib,
            "--train-iters",
            "2",
            "--pipeline-trace",
            "auto",
        ],
    )
    two_p, two_p_log = _launch(
        tmp_path,
        "zbh2",
        ["--pipeline-schedule", "zb-h2", "--train-iters", "2", "--pipeline-trace", str(tmp_path / "zbh2")],
    )
    text = _finish(auto, auto_log, iterations=2)
    _finish(two_p, two_p_log, iterations=2)
    chosen = CHOICE.search(text)
    assert chosen is not None and not chosen.group(1).endswith("@2p") and chosen.group(1) != "zb-h2", text[-3000:]
    measured_auto, measured_two_p = _worst_peak(tmp_path / "auto"), _worst_peak(tmp_path / "zbh2")
    print(f"budget {budget:.0f} B; measured worst-rank peak: auto ({chosen.group(1)}) {measured_auto} B, zb-h2 "
          f"{measured_two_p} B; memory model: {chosen.group(1)} {model_peak[chosen.group(1)].peak_memory:.0f} B, "
          f"zb-h2 {high:.0f} B")  # fmt: skip
    assert measured_auto <= budget, (chosen.group(1), measured_auto, budget)
    assert measured_two_p > budget, (measured_two_p, budget)
