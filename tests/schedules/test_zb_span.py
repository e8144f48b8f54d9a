"""zb-auto's span objective and W memory fraction, and back-to-back iterations.

Pure and fast: schedules up to p=8, m=32 with the zero-bubble paper's profiled 1.5B costs.
"""

from __future__ import annotations

import json

import pytest

from megatron_pp_ext.analysis import simulate
from megatron_pp_ext.schedules import ScheduleError, generate
from megatron_pp_ext.schedules.costs import Costs, stage_costs
from megatron_pp_ext.schedules.generators.zb_rounds import ROUND_VARIANTS, rounds_order
from megatron_pp_ext.schedules.generators.zero_bubble import post_validated_time, time_order
from megatron_pp_ext.schedules.timing import repeat_iterations

# the zero-bubble paper's profiled 1.5B model at p=8 (T_F, T_B, T_W, T_comm in ms)
PAPER_1_5B = Costs(18.522, 18.086, 9.337, None, 0.601)
# M_W / M_B of the 1.5B model with stored attention scores (planner/memory.w_memory_fraction)
W_1_5B = 32 * 2304 / (34 * 2304 + 5 * 24 * 1024)


def pv_time(schedule, costs: Costs, iterations: int = 4) -> float:
    result = simulate(schedule, costs, iterations=iterations, post_validation=True)
    assert result.iterations is not None
    return result.iterations.time


# ---- back-to-back iterations ------------------------------------------------------------------------
def test_repeat_iterations_sync_and_post_validated() -> None:
    # rank 1 starts 5 after rank 0 and ends 3 after it: spans 10 and 8, makespan 13
    def run_once(start: list[float]) -> list[float]:
        return [start[0] + 10.0, max(start[1], start[0] + 5.0) + 8.0]

    sync = repeat_iterations(run_once, 2, 4)
    assert sync.ready == [13.0, 26.0, 39.0, 52.0] and sync.time == 13.0
    pv = repeat_iterations(run_once, 2, 4, post_validation=True)
    assert pv.time == 10.0  # the longest span: rank 1's tail overlaps rank 0's next iteration
    stepped = repeat_iterations(run_once, 2, 3, step=[1.0, 2.0])
    assert stepped.ready == [15.0, 29.0, 43.0] and stepped.time == 14.0  # rank 0's step delays both
    with pytest.raises(ValueError, match="iterations"):
        repeat_iterations(run_once, 2, 0)
    with pytest.raises(ValueError, match="step"):
        repeat_iterations(run_once, 2, 2, step=[1.0])


def test_simulate_iterations_default_unchanged_and_sync_equals_makespan() -> None:
    schedule = generate("zb-h2", 4, 12)
    costs = Costs(1.0, 1.1, 0.6, None, 0.05)
    plain = simulate(schedule, costs)
    assert plain.iterations is None and "iterations" not in plain.to_json_dict()
    sync = simulate(schedule, costs, iterations=3)
    assert sync.iterations is not None and sync.iterations.time == pytest.approx(plain.makespan)
    stepped = simulate(schedule, costs, iterations=3, step_time=0.5)
    assert stepped.iterations is not None and stepped.iterations.time == pytest.approx(plain.makespan + 0.5)
    # 1F1B: rank 0 starts first and ends last, so post-validation gains nothing
    one = generate("1f1b", 4, 12)
    assert pv_time(one, costs) == pytest.approx(simulate(one, costs).makespan)
    with pytest.raises(ValueError, match="iterations"):
        simulate(schedule, costs, iterations=0)


def test_post_validated_time_is_the_simulators() -> None:
    """zb-auto's objective and ``simulate --iterations --post-validation`` are one notion."""
    sc = stage_costs(PAPER_1_5B, 8)
    schedule = generate("zb-auto", 8, 24, costs=PAPER_1_5B, memory_limit=16, objective="span", w_memory=W_1_5B)
    ours = post_validated_time([list(row) for row in schedule.ops], 24, sc, iterations=4)
    assert ours == pytest.approx(pv_time(schedule, PAPER_1_5B, 4), rel=1e-12)
    assert schedule.params["iteration_time"] == pytest.approx(ours, rel=1e-9)


# ---- W memory fraction ------------------------------------------------------------------------------------
@pytest.mark.parametrize("w", [1.0, 0.5, 0.3])
def test_engine_memory_is_the_simulators(w: float) -> None:
    sc = stage_costs(PAPER_1_5B, 6)
    for name in ("zb-h1", "zb-h2"):
        schedule = generate(name, 6, 14)
        timing = time_order([list(row) for row in schedule.ops], 14, sc, w)
        sim = simulate(schedule, PAPER_1_5B, w_retained_fraction=w)
        assert list(timing.peaks) == pytest.approx(sim.peak_activations)


@pytest.mark.parametrize("objective", ["makespan", "span"])
@pytest.mark.parametrize("w", [1.0, 0.6, 0.3])
def test_memory_limit_honoured_exactly(objective: str, w: float) -> None:
    tight = 0
    for p in (2, 3, 4, 6):
        for m in (p, 2 * p + 1, 3 * p):
            for limit in sorted({2, p, p + 1, 2 * p}):
                schedule = generate(
                    "zb-auto", p, m, costs=PAPER_1_5B, memory_limit=limit, objective=objective, w_memory=w
                )
                peak = max(simulate(schedule, PAPER_1_5B, w_retained_fraction=w).peak_activations)
                assert peak <= limit + 1e-9, (p, m, limit, peak)
                tight += peak > limit - 1
    assert tight > 20  # the limit binds in most cases: the check is not vacuous


def test_bad_parameters_refused() -> None:
    with pytest.raises(ScheduleError, match="objective"):
        generate("zb-auto", 4, 8, objective="fastest")
    for bad in (0, 0.0, 1.5, -1, True):
        with pytest.raises(ScheduleError, match="w_memory"):
            generate("zb-auto", 4, 8, w_memory=bad)
    with pytest.raises(ScheduleError, match="objective"):
        generate("zb-h2", 4, 8, objective="span")


def test_defaults_record_no_new_parameters() -> None:
    params = generate("zb-auto", 4, 8).params
    assert "objective" not in params and "w_memory" not in params


# ---- the span objective against the paper ----------------------------------------------------------------
@pytest.mark.parametrize(("m", "paper"), [(24, 0.0433), (32, 0.0039)])
def test_paper_zb_2p_reproduced(m: int, paper: float) -> None:
    """The paper's Table 5 ZB-2p bubble rate (1.5B, p=8) with its profiled costs (Table 9's m=24
    times, also used at m=32) and its W memory accounting, or better."""
    schedule = generate("zb-auto", 8, m, costs=PAPER_1_5B, memory_limit=16, objective="span", w_memory=W_1_5B)
    result = simulate(schedule, PAPER_1_5B, w_retained_fraction=W_1_5B)
    assert result.bubble_rate <= paper + 5e-5
    assert max(result.peak_activations) <= 16 + 1e-9


def test_span_objective_not_worse_than_its_rivals() -> None:
    """Under the same costs and accounting zb-auto(span) is at least as good as ZB-H1, ZB-H2 (where
    they fit) and every variant of the paper's round heuristic."""
    for p, m, costs in ((4, 12, PAPER_1_5B), (8, 32, PAPER_1_5B), (6, 20, Costs(1.0, 1.5, 0.7, None, 0.1))):
        sc = stage_costs(costs, p)
        for limit, w in ((p, 1.0), (2 * p, 1.0), (2 * p, W_1_5B), (p + 2, 0.5)):
            auto = generate("zb-auto", p, m, costs=costs, memory_limit=limit, objective="span", w_memory=w)
            best = pv_time(auto, costs, 3)
            for name in ("zb-h1", "zb-h2"):
                hand = generate(name, p, m)
                if max(simulate(hand, costs, w_retained_fraction=w).peak_activations) <= limit:
                    assert best <= pv_time(hand, costs, 3) + 1e-9
            for variant in ROUND_VARIANTS:
                try:
                    rows, _ = rounds_order(p, m, sc, limit, variant, w)
                except ValueError:
                    continue
                assert best <= post_validated_time(rows, m, sc) + 1e-9, (p, m, limit, w, variant.name)


@pytest.mark.parametrize("w", [1.0, W_1_5B])
@pytest.mark.parametrize("p", [4, 8])
def test_post_validated_zb_auto_beats_zb_h2_at_m_3p(p: int, w: float) -> None:
    m = 3 * p
    auto = generate("zb-auto", p, m, costs=PAPER_1_5B, memory_limit=2 * p, objective="span", w_memory=w)
    assert pv_time(auto, PAPER_1_5B) < pv_time(generate("zb-h2", p, m), PAPER_1_5B) - 1.0  # ms


# ---- the planner's W share and the command line --------------------------------------------------------
def test_w_memory_fraction_from_the_model_shape() -> None:
    from megatron_pp_ext.planner.memory import TrainingSetup, w_memory_fraction, wgrad_held_bytes
    from megatron_pp_ext.planner.models import ModelSpec, get_model

    model = get_model("zb-1.5b")
    unfused = TrainingSetup(attention="unfused")
    assert w_memory_fraction(model, 1, unfused, "none") == pytest.approx(W_1_5B)  # paper Table 1, bf16
    assert w_memory_fraction(model, 1, unfused, "selective") == pytest.approx(32 / 34)  # no 5as term kept
    assert w_memory_fraction(model, 1, unfused, "full") == 1.0  # capped
    # the CPU probe's layer (benchmarks/bench_wgrad_memory.py): 16 elements of h per token, fp32
    probe = ModelSpec("probe", 1, 256, 8, 128, hidden_dropout=0.0, attention_dropout=0.0)
    fp32 = TrainingSetup(precision="fp32", attention="unfused")
    assert wgrad_held_bytes(probe, 2, 1, fp32) == 4 * 128 * 2 * 16 * 256


def test_cli_post_validation_defaults_to_span(capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_pp_ext.cli import main

    argv = ["simulate", "zb-auto", "-p", "8", "-m", "24", "--costs", "18.522,18.086,9.337,0.601"]
    argv += ["--memory-limit", "2p", "--w-memory", "0.3664", "--iterations", "3"]
    assert main([*argv, "--post-validation", "--json"]) == 0
    span = json.loads(capsys.readouterr().out)
    assert main([*argv, "--json"]) == 0  # makespan objective, synchronous steps
    sync = json.loads(capsys.readouterr().out)
    assert span["bubble_rate"] <= 0.0434 < sync["bubble_rate"]
    assert span["iterations"]["post_validation"] and not sync["iterations"]["post_validation"]
    assert span["iterations"]["iteration_time"] < sync["iterations"]["iteration_time"]
    for bad, flag in (("0", "--w-memory"), ("1.2", "--w-memory"), ("0", "--iterations"), ("-1", "--step-time")):
        with pytest.raises(SystemExit) as exc:
            main(["simulate", "zb-auto", "-p", "4", "-m", "8", flag, bad])
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert flag in err[-1]


def test_cli_step_time_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_pp_ext.cli import main

    argv = ["simulate", "zb-h2", "-p", "4", "-m", "12", "--iterations", "3", "--json", "--step-time"]
    assert main([*argv, "0,0,0,2"]) == 0
    last = json.loads(capsys.readouterr().out)["iterations"]
    assert last["step"] == [0, 0, 0, 2]
    makespan = max(last["ends"][0])
    # rank 3's step hides under the forwards it waits for in the next iteration; rank 0's does not
    assert last["iteration_time"] == pytest.approx(makespan)
    assert main([*argv, "2,0,0,0"]) == 0
    assert json.loads(capsys.readouterr().out)["iterations"]["iteration_time"] == pytest.approx(makespan + 2)
    assert main([*argv, "1,2,3"]) == 2
    assert "--step-time" in capsys.readouterr().err.strip().splitlines()[-1]
