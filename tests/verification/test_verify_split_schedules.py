"""Zero-bubble and V-shape schedules on real gloo ranks: loss and every gradient equal the reference."""

from __future__ import annotations

import pytest

from megatron_pp_ext.schedules import Exchange, generate, lower, names
from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec
from megatron_pp_ext.verification.verify import verify_schedule

# m = p, m < p and m not a multiple of p at least once per family; the V shapes at p = 8 are in test_verify_p8
ZERO_BUBBLE = [
    ("zb-h1", 2, 2),
    ("zb-h1", 4, 6),
    ("zb-h2", 2, 3),
    ("zb-h2", 4, 3),
    ("zb-auto", 2, 4),
    ("zb-auto", 4, 5),
]

V_SHAPE = [
    ("v-min", 2, 4, True),
    ("v-min", 4, 4, False),
    ("v-half", 2, 4, False),
    ("v-half", 4, 4, True),
    ("v-zb", 2, 4, True),
    ("v-zb", 4, 5, False),
]


def _needs(name: str) -> None:
    if name not in names():
        pytest.skip(f"{name} is not registered")


@pytest.mark.parametrize(("name", "p", "m"), ZERO_BUBBLE)
def test_zero_bubble_schedules_verify(pool, name, p, m):
    _needs(name)
    report = verify_schedule(generate(name, p, m), pool, iterations=3)
    assert report.problems == []
    assert report.ok, report


@pytest.mark.parametrize(("name", "p", "m", "tied"), V_SHAPE)
def test_v_shape_schedules_verify(pool, name, p, m, tied):
    _needs(name)
    schedule = generate(name, p, m)
    model = TinyGPTSpec(num_layers=2 * p, tied_embeddings=tied)
    report = verify_schedule(schedule, pool, model=model, iterations=3)
    assert report.problems == []
    assert report.ok, report


@pytest.mark.parametrize("name", ["v-half", "zb-h1"])
def test_tensor_parallel_2_with_pipeline_2(pool, name):
    _needs(name)
    schedule = generate(name, 2, 4)
    model = TinyGPTSpec(num_layers=schedule.placement.stages_per_replica)
    report = verify_schedule(schedule, pool, model=model, tp=2, iterations=2)
    assert report.problems == []
    assert report.ok, report


@pytest.mark.parametrize("name", ["v-zb", "v-half"])
def test_v_shape_at_p2_without_tags(pool, name):
    """The PP=2 trap: rank 0 and 1 trade activations and gradients of one shape in both directions.

    With every tag 0 (NCCL ignores tags) only the order the lowering gives each channel keeps
    them apart; a swap would corrupt every gradient without an error.
    """
    _needs(name)
    schedule = generate(name, 2, 6)
    mixed = [
        ins
        for rank in range(2)
        for ins in lower(schedule).program(rank)
        if isinstance(ins, Exchange) and len({m.kind for m in (*ins.sends, *ins.recvs)}) == 2
    ]
    assert mixed, "expected exchanges that carry an activation and a gradient together"
    report = verify_schedule(schedule, pool, model=TinyGPTSpec(num_layers=4), iterations=2, p2p_tags=False)
    assert report.problems == []
    assert report.ok, report
