"""MoE models (megatron's MoE layer, SequentialMLP experts, top-2 routing with the load-balancing loss)
under our executor, against the references: losses and every gradient, router and experts included.

Expert parallelism: ``ep`` of the ``dp`` data-parallel ranks share the experts, tokens travel by the
all-to-all dispatcher over gloo. The load-balancing loss must be counted once per micro-batch as
megatron's ``forward_step`` scales it (``test_verify_breaks.py``: counted twice fails by far).
"""

from __future__ import annotations

import pytest

from megatron_pp_ext.schedules import generate
from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec
from megatron_pp_ext.verification.verify import verify_schedule

P, M = 2, 4


def moe_model(schedule_name: str) -> TinyGPTSpec:
    stages = generate(schedule_name, P, M).placement.stages_per_replica
    return TinyGPTSpec(num_layers=stages, num_experts=4, moe_topk=2)


def verify_moe(pool, name: str, ep: int):
    return verify_schedule(generate(name, P, M), pool, model=moe_model(name), dp=ep, ep=ep, iterations=2)


@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_moe_without_expert_parallelism(pool, name: str) -> None:
    report = verify_moe(pool, name, ep=1)
    assert report.problems == []
    assert report.ok, report.describe()
    if name == "1f1b":  # megatron's own order: bit for bit megatron's 1F1B
        assert report.bitwise_megatron_1f1b is True


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "v-zb", "dualpipev"])
def test_moe_with_expert_parallelism(pool, name: str) -> None:
    """EP = 2 x PP = 2 on 4 ranks (the experts split over the two data-parallel replicas)."""
    report = verify_moe(pool, name, ep=2)
    assert report.problems == []
    assert report.ok, report.describe()
    if name == "1f1b":
        assert report.bitwise_megatron_1f1b is True


def test_moe_requests_megatron_cannot_build_are_refused() -> None:
    with pytest.raises(ValueError, match="--dp 1 must be a multiple"):
        verify_schedule(generate("1f1b", P, M), model=moe_model("1f1b"), ep=2)
    with pytest.raises(ValueError, match="add --num-experts"):
        verify_schedule(generate("1f1b", P, M), model=TinyGPTSpec(num_layers=P), dp=2, ep=2)
