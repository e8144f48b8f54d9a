"""``--pipeline-schedule auto``: the flags checked by the argument validation (no search there), the planner's
choice made on the install path (integration/auto_schedule.py), its table, the budget."""

from __future__ import annotations

import pytest
from megatron_args_helpers import TINY_SHAPE, make_args

from megatron_pp_ext.integration.arguments import validate_arguments
from megatron_pp_ext.integration.auto_schedule import planner_for_run, resolve
from megatron_pp_ext.integration.config import PipelineArgumentError, PipelineConfig

TINY = TINY_SHAPE  # at 4 ranks (megatron's default pipeline size in make_args)


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
    from megatron_pp_ext.integration import install as inst

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

    from megatron_pp_ext.integration import auto_schedule

    monkeypatch.setattr(auto_schedule, "decide", zeropp_u2_only)
    args = make_args(["--pipeline-schedule", "auto", "--cpu", "--pipeline-memory-budget", "4"], **TINY)
    config = _decided(args)
    assert config.schedule == "zeropp" and config.unit_size == 2
    assert config.build(4, 8).params["unit_size"] == 2


def test_redecision_switches_to_what_the_measured_costs_favour() -> None:
    """At 10 micro-batches the start-up choice is dualpipev; a backward-heavy measured profile (F 5, B 20, W 4.5 ms
    per 1F1B stage) makes the planner rank v-zb@2p first: the re-decision switches, logs it, and the configuration
    it returns builds v-zb with the measured costs; a second call returns the same decision."""
    from megatron_pp_ext.integration.auto_schedule import Redecision
    from megatron_pp_ext.schedules.costs import Costs

    argv = ["--pipeline-schedule", "auto", "--cpu", "--pipeline-memory-budget", "4", "--pipeline-replan"]
    args = make_args(argv, **{**TINY, "global_batch_size": 20})
    config = _decided(args)
    assert config.schedule == "dualpipev" and isinstance(config.redecide, Redecision)
    logged: list[str] = []
    config.redecide.log = logged.append
    # per global stage of the V placement (8 stages, one replica): one 1F1B stage (2 of them) is F 5, B 20, W 4.5 ms
    measured = Costs(t_f=2.5e-3, t_b=10e-3, t_w=2.25e-3, t_comm=1e-4)
    new = config.redecide(measured)
    assert config.redecide.measured_stage_ms == pytest.approx((5.0, 20.0, 4.5))
    assert (new.schedule, str(new.memory_limit)) == ("v-zb", "2p"), logged
    assert new.costs is measured
    assert "switching dualpipev -> v-zb@2p" in logged[0]
    built = new.build(4, 10)
    assert built.name == "v-zb" and built.ops != config.build(4, 10).ops
    assert config.redecide(Costs(t_f=1.0, t_b=1.0, t_w=1.0)) is new and len(logged) == 1  # decided once


def test_redecision_keeps_the_running_schedule_when_it_is_still_first() -> None:
    """Running v-zb@2p under the same measured costs: kept (rebuilt with the measured costs, it is cost-aware)."""
    from dataclasses import replace

    from megatron_pp_ext.integration.auto_schedule import Redecision
    from megatron_pp_ext.integration.config import parse_pipeline_memory_limit
    from megatron_pp_ext.schedules.costs import Costs

    argv = ["--pipeline-schedule", "auto", "--cpu", "--pipeline-memory-budget", "4", "--pipeline-replan"]
    args = make_args(argv, **{**TINY, "global_batch_size": 20})
    running = replace(_decided(args), schedule="v-zb", memory_limit=parse_pipeline_memory_limit("2p"))
    logged: list[str] = []
    again = Redecision(args, running, cpu=True, overlap=0.0, log=logged.append)
    measured = Costs(t_f=2.5e-3, t_b=10e-3, t_w=2.25e-3)
    kept = again(measured)
    assert (kept.schedule, kept.memory_limit) == ("v-zb", running.memory_limit) and kept.costs is measured
    assert "keeping v-zb@2p" in logged[0] and "switching" not in logged[0]


def _one_f_one_b(**megatron: object) -> object:
    """auto's 1f1b row for the TINY run with ``megatron``'s args (the uneven-split flags) changed."""
    from megatron_pp_ext.planner.auto import decide

    args = make_args(["--pipeline-schedule", "auto", "--cpu", "--pipeline-memory-budget", "4"], **{**TINY, **megatron})
    return decide(planner_for_run(args, budget_gib=4.0, stage_costs_ms=None, cpu=True), ("1f1b",)).chosen


def test_auto_plans_with_the_runs_uneven_split() -> None:
    """The run's split is what auto simulates: 5 of 8 layers on the first stage make 1f1b slower than the even
    split, 7 layers with one on the first stage faster; a layout string giving the first-5 split predicts what
    the flags do (one parser)."""
    even = _one_f_one_b()
    heavy = _one_f_one_b(decoder_first_pipeline_num_layers=5)
    light = _one_f_one_b(num_layers=7, decoder_first_pipeline_num_layers=1)
    layout = _one_f_one_b(pipeline_model_parallel_layout="Ettttt|t|t|tL")
    assert (even.config.split, heavy.config.split, light.config.split) == ((2, 2, 2, 2), (5, 1, 1, 1), (1, 2, 2, 2))
    assert light.iteration_time < even.iteration_time < heavy.iteration_time
    assert layout.config.split == heavy.config.split and layout.iteration_time == pytest.approx(heavy.iteration_time)


def test_auto_finds_a_schedule_for_a_split_neither_even_nor_embedding_loss(capsys: pytest.CaptureFixture[str]) -> None:
    """7 layers, one on the first of 4 stages: no even or embedding-and-loss split exists, the run's own does;
    auto picks a schedule whose placement maps it, and names why the others were skipped: V placements (8
    stages: 6 layers do not split over the other 7) and interleaved loops (megatron splits those per rank)."""
    args = make_args(
        ["--pipeline-schedule", "auto", "--cpu", "--pipeline-memory-budget", "4"],
        **{**TINY, "num_layers": 7, "decoder_first_pipeline_num_layers": 1},
    )
    config = _decided(args)
    assert config.schedule not in (None, "auto") and config.build(4, 8).placement.style == "loop"
    table = config.auto_table or ""
    assert "dropped dualpipev: not applicable: the run's layer split does not map onto its v placement" in table
    assert "dropped interleaved-zb: not applicable: the run's layer split does not map onto its loop placement" in table
    assert "megatron splits by pipeline rank" in table


def test_auto_with_a_layout_of_one_stage_per_rank_picks_a_one_chunk_loop_schedule() -> None:
    """A layout of p stages is megatron's own split of its one-chunk loop: auto plans with it and picks a schedule
    of that placement (V placements have 2p stages: dropped with the reason); more stages are refused."""
    layout = "Ettttt|t|t|tL"
    config = _decided(
        make_args(
            ["--pipeline-schedule", "auto", "--cpu", "--pipeline-memory-budget", "4"],
            **{**TINY, "pipeline_model_parallel_layout": layout},
        )
    )
    schedule = config.build(4, 8)
    assert schedule.placement.style == "loop" and schedule.chunks_per_rank == 1
    assert "dropped dualpipev: not applicable: the run's layer split does not map" in (config.auto_table or "")
    with pytest.raises(PipelineArgumentError, match="with --pipeline-schedule auto a layout gives one stage per"):
        validate_arguments(
            make_args(
                ["--pipeline-schedule", "auto", "--cpu", "--pipeline-memory-budget", "4"],
                **{**TINY, "pipeline_model_parallel_layout": "Et|t|t|t|t|t|t|tL"},
            )
        )


def test_auto_without_split_flags_plans_the_even_split_megatron_builds() -> None:
    """6 layers at PP = 2 without split flags: megatron builds the even split, so the V / bidirectional placements
    (4 stages) do not apply and auto's choice passes the schedule checks (an embedding-and-loss split of the
    planner's own would have ranked one first, which the run then refuses)."""
    args = make_args(
        ["--pipeline-schedule", "auto", "--cpu", "--pipeline-memory-budget", "4"],
        **{**TINY, "num_layers": 6, "pipeline_model_parallel_size": 2},
    )
    config = _decided(args)
    assert config.build(2, 8).placement.style == "loop"
    assert "dropped bitpipe-zb: not applicable: the run's layer split does not map" in (config.auto_table or "")
