"""``--pipeline-schedule auto``: the flags checked by the argument validation (no search there), the planner's
choice made on the install path (megatron/auto_schedule.py), its table, the budget."""

from __future__ import annotations

import pytest
from megatron_args_helpers import make_args

from megatron_pp_ext.megatron.arguments import PipelineArgumentError, PipelineConfig, validate_arguments
from megatron_pp_ext.megatron.auto_schedule import planner_for_run, resolve

TINY = {  # scripts/run_tiny_cpu.sh's shapes at 4 ranks
    "num_layers": 8,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "seq_length": 64,
    "vocab_size": 256,
    "micro_batch_size": 2,
    "global_batch_size": 16,
    "hidden_dropout": 0.0,
    "attention_dropout": 0.0,
}


def _decided(args: object) -> PipelineConfig:
    return resolve(args, validate_arguments(args))


def test_validation_checks_auto_flags_without_searching(capsys: pytest.CaptureFixture[str]) -> None:
    config = validate_arguments(
        make_args(["--pipeline-schedule", "auto", "--cpu", "--pipeline-memory-budget", "4"], **TINY)
    )
    assert config.schedule == "auto" and config.memory_budget == 4.0 and config.auto_table is None
    assert capsys.readouterr().out == ""


def test_auto_resolves_to_a_schedule_and_prints_its_table(capsys: pytest.CaptureFixture[str]) -> None:
    args = make_args(["--pipeline-schedule", "auto", "--cpu", "--pipeline-memory-budget", "4"], **TINY)
    config = _decided(args)
    assert config.schedule not in (None, "auto") and config.auto_table is not None
    out = capsys.readouterr().out
    assert out.startswith(f"pipeline schedule auto: {config.schedule}")
    assert config.build(4, 8).name == config.schedule


def test_a_budget_below_the_2p_schedules_picks_a_p_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    """Budgets from the auto table of a generous run: just above the least memory of a p schedule (zb-h1) and
    below zb-h2's, auto picks something that fits and never a 2p schedule."""
    from megatron_pp_ext.planner.auto import decide

    generous = make_args(["--pipeline-schedule", "auto", "--cpu", "--pipeline-memory-budget", "4"], **TINY)

    rows = decide(planner_for_run(generous, budget_gib=4.0, stage_costs_ms=None, cpu=True)).result.rows
    peak = {
        r.config.schedule + (f"@{r.config.memory_limit}" if r.config.memory_limit else ""): r.peak_memory for r in rows
    }
    low, high = peak["zb-h1"], peak["zb-h2"]
    assert low < high
    budget = (low + high) / 2 / 2**30
    args = make_args(["--pipeline-schedule", "auto", "--cpu", "--pipeline-memory-budget", f"{budget}"], **TINY)
    config = _decided(args)
    chosen = config.schedule + (f"@{config.memory_limit}" if config.memory_limit is not None else "")
    assert config.schedule not in ("zb-h2",) and not chosen.endswith("@2p")
    assert "dropped zb-h2: over budget" in (config.auto_table or "")


def test_budget_needs_auto_and_cpu_auto_needs_a_budget() -> None:
    with pytest.raises(PipelineArgumentError, match="needs --pipeline-schedule auto"):
        validate_arguments(make_args(["--pipeline-schedule", "1f1b", "--pipeline-memory-budget", "4"], **TINY))
    with pytest.raises(PipelineArgumentError, match="needs a budget"):
        validate_arguments(make_args(["--pipeline-schedule", "auto", "--cpu"], **TINY))
    for flag, value in (("--pipeline-overlap", "0.5"), ("--pipeline-replan", None)):
        argv = ["--pipeline-schedule", "1f1b", flag] + ([value] if value else [])
        with pytest.raises(PipelineArgumentError, match=f"argument {flag}: needs --pipeline-schedule auto"):
            validate_arguments(make_args(argv, **TINY))
    with pytest.raises(PipelineArgumentError, match="no schedule fits in 1e-06 GiB per rank") as info:
        _decided(make_args(["--pipeline-schedule", "auto", "--cpu", "--pipeline-memory-budget", "1e-6"], **TINY))
    assert "\n" not in str(info.value)  # one line (the table went to stdout just before)


def test_overlap_flag_reaches_the_decision(capsys: pytest.CaptureFixture[str]) -> None:
    args = make_args(
        ["--pipeline-schedule", "auto", "--cpu", "--pipeline-memory-budget", "4", "--pipeline-overlap", "1"], **TINY
    )
    assert "overlap F=1" in (_decided(args).auto_table or "")


def test_install_decides_auto_and_refuses_an_undecided_config() -> None:
    from megatron_pp_ext.megatron import install as inst

    with pytest.raises(PipelineArgumentError, match="call install\\(args\\)"):
        inst._config_of(PipelineConfig(schedule="auto"))
    args = make_args(["--pipeline-schedule", "auto", "--cpu", "--pipeline-memory-budget", "4"], **TINY)
    config = inst._config_of(args)
    assert config.schedule not in (None, "auto") and config.redecide is None
    replan = make_args(
        ["--pipeline-schedule", "auto", "--cpu", "--pipeline-memory-budget", "4", "--pipeline-replan"], **TINY
    )
    config = inst._config_of(replan)
    assert config.redecide is not None and config.replan_iterations == 3


def test_auto_runs_the_unit_size_it_evaluated(monkeypatch: pytest.MonkeyPatch) -> None:
    """When auto's choice is a zeropp row of unit size U, the run builds zeropp with that U (not its default)."""
    from megatron_pp_ext.planner import auto

    real = auto.decide

    def zeropp_u2_only(planner: auto.Planner) -> auto.AutoDecision:
        decision = real(planner)
        decision.result.rows = [r for r in decision.result.rows if r.config.unit_size == 2]
        return decision

    from megatron_pp_ext.megatron import auto_schedule

    monkeypatch.setattr(auto_schedule, "decide", zeropp_u2_only)
    args = make_args(["--pipeline-schedule", "auto", "--cpu", "--pipeline-memory-budget", "4"], **TINY)
    config = _decided(args)
    assert config.schedule == "zeropp" and config.unit_size == 2
    assert config.build(4, 8).params["unit_size"] == 2
