"""The simulator's host costs: a measured cost per op and per exchange, charged as busy time of the rank."""

from __future__ import annotations

import pytest

from megatron_pp_ext.analysis.host_costs import with_host_costs
from megatron_pp_ext.analysis.simulate import simulate
from megatron_pp_ext.schedules import generate
from megatron_pp_ext.schedules.costs import Costs


def test_zero_host_costs_leave_the_simulation_as_it_was() -> None:
    schedule = generate("zb-h1", 4, 8)
    costs = Costs(1.0, 1.1, 0.6, None, 0.05)
    charged = with_host_costs(costs, schedule.placement)
    assert charged.per_stage(4) == costs.per_stage(4)
    assert simulate(schedule, charged).makespan == simulate(schedule, costs).makespan


def test_per_op_on_every_op_per_exchange_only_on_ops_whose_output_crosses_ranks() -> None:
    schedule = generate("v-zb", 2, 4)  # V: stage 0 -> 1 crosses, 1 -> 2 stays on rank 1, 2 -> 3 crosses
    f, b, w, bw = with_host_costs(Costs(1.0, 1.0, 1.0), schedule.placement, 0.1, 0.01).per_stage(4)
    assert f == pytest.approx([1.11, 1.1, 1.11, 1.1])  # the last stage's F sends nothing (its loss stays)
    assert b == pytest.approx([1.1, 1.11, 1.1, 1.11])  # the first stage's B sends nothing
    assert w == pytest.approx([1.1] * 4)  # W sends nothing
    assert bw == pytest.approx([2.1, 2.11, 2.1, 2.11])


def test_host_costs_lengthen_the_plan_and_negative_ones_are_refused() -> None:
    schedule = generate("1f1b", 2, 4)
    costs = Costs(1.0, 1.0, 1.0)
    assert (
        simulate(schedule, with_host_costs(costs, schedule.placement, 0.1, 0.1)).makespan
        > simulate(schedule, costs).makespan
    )
    with pytest.raises(ValueError, match="host cost per_exchange must be >= 0, got -1"):
        with_host_costs(costs, schedule.placement, 0.0, -1.0)
