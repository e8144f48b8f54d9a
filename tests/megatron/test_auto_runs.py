"""``--pipeline-schedule auto`` in real training runs (scripts/pretrain_gpt.py, 4 CPU ranks over gloo).

* ``--pipeline-replan``: after one profiled iteration, auto decides again from the measured costs. The log
  line must carry the measured profile (the one ``--pipeline-profile-out`` writes), and its choice and time
  must be what the planner gives for those costs (recomputed here from the written profile).
* Memory: with a budget between the memory model's zb-h1 and zb-h2 peaks (excluding the 2p schedules), the
  MEASURED peak of auto's pick (parameters and gradient buffers as allocated, Adam's moments by accounting,
  plus the tracer's peak of live activation bytes) is within the budget, and zb-h2's measured peak is not.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from megatron_args_helpers import make_args

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "pretrain_gpt.py"
SHAPE = {  # megatron's values for these flags (dropouts: megatron's defaults)
    "num_layers": 8,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_length": 64,
    "vocab_size": 256,
    "micro_batch_size": 2,
    "global_batch_size": 16,
    "hidden_dropout": 0.1,
    "attention_dropout": 0.1,
    "pipeline_model_parallel_size": 4,
}
FLAGS = [
    "--cpu", "--pipeline-model-parallel-size", "4",
    "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64",
    "--micro-batch-size", "2", "--global-batch-size", "16", "--lr", "1e-3",
    "--eval-interval", "1000", "--eval-iters", "0", "--log-interval", "1", "--num-workers", "0",
]  # fmt: skip
ITERATION = re.compile(r"iteration\s+(\d+)/\s*(\d+) .*lm loss: ([0-9.E+-]+)")
CHOICE = re.compile(r"pipeline schedule auto: (\S+) \(v=(\d+), (\w+) placement\): iteration (\S+) ms")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(tmp: Path, name: str, extra: list[str]) -> tuple[subprocess.Popen[bytes], Path]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    log = tmp / f"{name}.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port", str(_free_port())]
    proc = subprocess.Popen(
        [*cmd, str(SCRIPT), *FLAGS, *extra], cwd=tmp, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT
    )
    return proc, log


def _finish(proc: subprocess.Popen[bytes], log: Path, iterations: int) -> str:
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
    from megatron_pp_ext.megatron.auto_schedule import planner_for_run
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


def _worst_peak(trace_dir: Path) -> int:
    summaries = sorted(trace_dir.rglob("summary_rank*.json"))
    assert len(summaries) == 4, summaries
    peaks = [json.loads(p.read_text())["peak_bytes"] for p in summaries]
    assert all(isinstance(x, int) and x > 0 for x in peaks), peaks
    return max(peaks)


@pytest.mark.gloo
def test_auto_never_picks_a_schedule_whose_measured_peak_exceeds_the_budget(tmp_path: Path) -> None:
    from megatron_pp_ext.megatron.auto_schedule import planner_for_run
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
