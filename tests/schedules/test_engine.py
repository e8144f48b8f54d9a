"""The list-scheduling engine: its clock is the simulator's (async comm), its memory the simulator's."""

from __future__ import annotations

import pytest

from megatron_pp_ext.analysis.simulate import simulate
from megatron_pp_ext.schedules import generate
from megatron_pp_ext.schedules.costs import Costs, stage_costs
from megatron_pp_ext.schedules.engine import Engine, backward, forward
from megatron_pp_ext.schedules.ir import B, F, W
from megatron_pp_ext.schedules.order_timing import replay
from megatron_pp_ext.schedules.placement import loop_placement, v_placement

COSTS = (Costs(1.0, 1.0, 1.0), Costs(1.0, 1.5, 0.7, None, 0.1), Costs((1.0, 1.2, 0.9, 1.1) * 2, 1.4, 0.6, None, 0.05))


@pytest.mark.parametrize("name", ["zb-h1", "zb-h2", "zb-auto", "v-min", "v-half", "v-zb"])
@pytest.mark.parametrize("costs", COSTS)
@pytest.mark.parametrize(("p", "m"), [(2, 3), (4, 4), (4, 9)])
def test_replay_times_an_order_like_the_simulator(name: str, costs: Costs, p: int, m: int) -> None:
    stages = 2 * p if name.startswith("v-") else p
    if isinstance(costs.t_f, tuple):
        costs = Costs(costs.t_f[:stages], costs.t_b, costs.t_w, None, costs.t_comm)
    kwargs = {"costs": costs} if name in ("zb-auto", "v-zb") else {}
    schedule = generate(name, p, m, **kwargs)  # type: ignore[arg-type]
    timing = replay(schedule.placement, m, stage_costs(costs, stages), schedule.ops)
    sim = simulate(schedule, costs)
    assert timing.makespan == pytest.approx(sim.makespan, abs=1e-9)
    assert list(timing.spans) == pytest.approx(sim.span, abs=1e-9)
    assert list(timing.peaks) == sim.peak_activations
    assert timing.bubble_rate == pytest.approx(sim.bubble_rate, abs=1e-9)


def test_op_encoding_and_bookkeeping_on_a_v() -> None:
    sc = stage_costs(Costs(1.0, 2.0, 0.5, None, 0.25), 4)
    eng = Engine(v_placement(2), 1, sc)
    assert eng.stage_of == [[0, 3], [1, 2]]
    f0, f1, b0, b1 = forward(0, 2), forward(1, 2), backward(0, 2), backward(1, 2)
    assert eng.arrival(0, f0) == 0.0 and eng.arrival(1, f0) is None
    eng.run(0, f0, 0.0)
    assert eng.arrival(1, f0) == 1.25  # one hop after F0.0 ends
    eng.run(1, f0, 1.25)
    assert eng.arrival(1, f1) == 2.25  # the turn of the V is local: no hop
    eng.run(1, f1, 2.25)
    eng.run(0, f1, eng.arrival(0, f1))  # type: ignore[arg-type]
    assert eng.live == [2, 2] and eng.peak == [2, 2]
    eng.run(0, b1, eng.arrival(0, b1))  # type: ignore[arg-type]  # the last stage's B needs its own F only
    eng.run_w(0)
    assert eng.live[0] == 1 and eng.rows[0] == [F(0, 0), F(3, 0), B(3, 0), W(3, 0)]
    assert eng.arrival(1, b1) == eng.b_end[3][0] + 0.25
    assert eng.arrival(1, b0) is None


def test_replay_refuses_a_deadlocked_order() -> None:
    sc = stage_costs(None, 2)
    with pytest.raises(AssertionError, match="deadlock"):
        replay(loop_placement(2), 1, sc, [[F(0, 0), B(0, 0), W(0, 0)], [B(1, 0), F(1, 0), W(1, 0)]])


@pytest.mark.parametrize("spec", ["B0 F0 F1 B1 W +cap", "B0 B1 F1 W F0"])
@pytest.mark.parametrize("costs", COSTS)
@pytest.mark.parametrize(("p", "m"), [(2, 3), (4, 9)])
def test_the_engines_clock_is_the_timing_core(spec: str, costs: Costs, p: int, m: int) -> None:
    """An order built on the engine with every pass at its rank's clock or its input's arrival
    (the earliest-first driver) is timed the same, to the last bit, by the timing core."""
    from megatron_pp_ext.schedules.generators.zbv import handcrafted

    if isinstance(costs.t_f, tuple):
        costs = Costs(costs.t_f[: 2 * p], costs.t_b, costs.t_w, None, costs.t_comm)
    sc = stage_costs(costs, 2 * p)
    built = handcrafted(p, m, sc, 2 * p, spec)
    assert built is not None
    rows, timing = built
    assert replay(v_placement(p), m, sc, rows) == timing
