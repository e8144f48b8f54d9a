"""Per-layer costs (planner/layer_costs.py) and the two value parsers they read (schedules/values.py)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from megatron_pp_ext.planner.cost_model import CostModel, get_device
from megatron_pp_ext.planner.layer_costs import (
    MeasuredLayers,
    kind_activation_bytes,
    kind_flops,
    kind_layout,
    layer_cost_table,
    slice_costs,
    stage_costs,
)
from megatron_pp_ext.planner.memory import TrainingSetup, layer_activation_bytes, stage_layout
from megatron_pp_ext.planner.models import ModelSpec, kind_parameters, parameter_counts
from megatron_pp_ext.schedules import registry
from megatron_pp_ext.schedules.values import parse_layer_costs

SETUP = TrainingSetup()
DENSE = ModelSpec(
    "d",
    8,
    1024,
    16,
    512,
    vocab_size=32000,
    swiglu=True,
    num_query_groups=4,
    ffn_hidden_size=2816,
    normalization="RMSNorm",
    add_bias_linear=False,
)
MOE = replace(DENSE, name="moe", num_experts=8, moe_ffn_hidden_size=1408, moe_first_dense_layers=2)


def cost(model: ModelSpec) -> CostModel:
    return CostModel(model, get_device("A100-80GB"), SETUP)


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_dense_layers_are_the_cost_models_layers(recompute: str) -> None:
    """Dense stage costs equal CostModel.stage_costs; the embedding adds to the first stage only."""
    sched = registry.generate("1f1b", 4, 8)
    layout = stage_layout(sched.placement, (3, 2, 2, 1))
    old = cost(DENSE).stage_costs(
        layout, micro_batch=2, tensor_parallel=2, pipeline=4, data_parallel=1, recompute=recompute
    )
    table = layer_cost_table(cost(DENSE), 2, 2, recompute)
    new = stage_costs(table, layout, sched.placement, old.t_comm)
    emb = table.embedding
    assert emb.f > 0 and emb.b == 0 and emb.w > 0
    for i in range(4):
        assert math.isclose(new.t_f[i] - (emb.f if i == 0 else 0), old.t_f[i], rel_tol=1e-12)
        assert math.isclose(new.t_b[i], old.t_b[i], rel_tol=1e-12)
        assert math.isclose(new.t_w[i] - (emb.w if i == 0 else 0), old.t_w[i], rel_tol=1e-12)


def test_output_layer_grows_with_the_vocabulary() -> None:
    small = layer_cost_table(cost(DENSE), 1, 1, "none")
    large = layer_cost_table(cost(replace(DENSE, vocab_size=128256)), 1, 1, "none")
    ratio = (large.head.f - 30e-6) / (small.head.f - 30e-6)  # minus the fixed kernel overhead
    assert math.isclose(ratio, 128256 / 32000, rel_tol=0.01)
    assert large.layers == small.layers


def test_attention_plus_mlp_is_a_dense_layer() -> None:
    for t in (1, 2):
        assert math.isclose(
            kind_parameters(DENSE, "attention", t) + kind_parameters(DENSE, "mlp", t),
            kind_parameters(DENSE, "dense", t),
        )
        for recompute in ("none", "selective"):
            parts = sum(kind_activation_bytes(DENSE, k, 2, t, SETUP, recompute) for k in ("attention", "mlp"))
            assert math.isclose(parts, layer_activation_bytes(DENSE, 2, t, SETUP, recompute))
    gemm_a, core_a = kind_flops(DENSE, "attention", 2)
    gemm_m, core_m = kind_flops(DENSE, "mlp", 2)
    gemm, core = kind_flops(DENSE, "dense", 2)
    assert math.isclose(gemm_a + gemm_m, gemm) and core_a + core_m == core


def test_moe_layers_cost_their_routed_experts() -> None:
    assert MOE.layer_kinds() == ("dense",) * 2 + ("moe",) * 6
    gemm_moe, _ = kind_flops(MOE, "moe", 1)
    gemm_attn, _ = kind_flops(MOE, "attention", 1)
    per_expert = 2.0 * 512 * (1024 * 2 * 1408 + 1408 * 1024)
    assert math.isclose(gemm_moe - gemm_attn, 2 * per_expert + 2.0 * 512 * 1024 * 8)  # top-2 + router
    expert = 1024 * 2 * 1408 + 1408 * 1024
    assert math.isclose(kind_parameters(MOE, "moe") - kind_parameters(MOE, "attention"), 8 * expert + 8 * 1024 + 1024)
    assert MOE.num_parameters() > DENSE.num_parameters() + 6 * 6 * expert


def test_measured_kinds_replace_the_estimate_scaled() -> None:
    entries, mb, tp = parse_layer_costs("dense=2,4,2; head=6,6,5; micro_batch=2")
    measured = MeasuredLayers.from_ms(entries, mb, tp)
    table = layer_cost_table(cost(DENSE), 4, 2, "none", measured)  # twice the micro-batch, half per TP rank
    tp_f, _ = cost(DENSE).tp_comm_per_layer(4, 2)
    assert math.isclose(table.layers[0].f, 2e-3 + tp_f) and math.isclose(table.layers[0].w, 2e-3)
    assert math.isclose(table.head.f, 6e-3) and math.isclose(table.head.w, 5e-3)
    estimate = layer_cost_table(cost(DENSE), 4, 2, "none")
    assert table.embedding == estimate.embedding  # not measured: the model's estimate


def test_slice_costs_put_embedding_first_and_head_last() -> None:
    table = layer_cost_table(cost(DENSE), 1, 1, "none")
    slices = slice_costs(table, (0, 4, 4, 0))
    assert slices[0] == table.embedding and slices[3] == table.head
    assert math.isclose(slices[1].f, 4 * table.layers[0].f)
    with pytest.raises(ValueError, match="holds 7 layers, the model has 8"):
        slice_costs(table, (3, 4))


def test_kind_layout_weighs_moe_stages() -> None:
    sched = registry.generate("1f1b", 2, 4)
    plain = stage_layout(sched.placement, (4, 4))
    assert kind_layout(DENSE, SETUP, sched.placement, (4, 4), 1, 1, "none") == plain
    mixed = kind_layout(MOE, SETUP, sched.placement, (4, 4), 1, 1, "none")
    assert mixed[1].activation_layers > mixed[0].activation_layers > 4  # 2 dense + 2 MoE vs 4 MoE
    assert math.isclose(mixed[1].params or 0, 4 * kind_parameters(MOE, "moe"))
    assert math.isclose(mixed[0].params or 0, 2 * parameter_counts(MOE).layer + 2 * kind_parameters(MOE, "moe"))


def test_hybrid_pattern_kinds() -> None:
    hybrid = replace(DENSE, name="h", num_layers=6, hybrid_pattern="M-M*-E", num_experts=4)
    assert hybrid.layer_kinds() == ("mamba", "mlp", "mamba", "attention", "mlp", "moe-mlp")
    table = layer_cost_table(cost(hybrid), 1, 1, "none")
    assert table.layers[0].w > 0 and table.layers[0].b > table.layers[0].w  # scan: in B, not in W
    with pytest.raises(ValueError, match="hybrid pattern must be 6 characters"):
        replace(DENSE, name="h", num_layers=6, hybrid_pattern="M-M*")


def test_moe_preset_plans_with_per_layer_costs() -> None:
    from megatron_pp_ext.planner.models import get_model
    from megatron_pp_ext.planner.search import Planner
    from megatron_pp_ext.planner.space import SearchSpace

    model = get_model("deepseek-v2-lite")
    space = SearchSpace(
        tp=(1,), pp=(4,), micro_batch=(1,), recompute=("full",), schedules=("1f1b",), virtual=(1,), layer_split="search"
    )
    plan = Planner(model, 8, 64, cost(model), space=space)
    assert plan.per_layer  # MoE layers differ from the dense first one
    rows = plan.run(progress=False).rows
    assert rows and all(r.config.layout for r in rows)  # 27 layers: no uniform split over 4 stages
    assert sum(m.parameters for m in rows[0].memory) == pytest.approx(model.num_parameters(), rel=1e-6)


def test_model_flops_count_each_layer_by_its_kind() -> None:
    """MFU's numerator: a hybrid pattern of attention + MLP pairs is the dense model of half as many layers
    (it counted every hybrid layer as a whole GPT layer, and plan printed MFU over 100%); a MoE model counts
    its routed experts, not a dense MLP."""
    from megatron_pp_ext.planner.cost_model import model_flops_per_iteration

    hybrid = replace(DENSE, name="h", num_layers=16, hybrid_pattern="*-" * 8)
    assert math.isclose(model_flops_per_iteration(hybrid, 4), model_flops_per_iteration(DENSE, 4))
    moe_layers = 2 * sum(kind_flops(MOE, "dense", 4)) + 6 * sum(kind_flops(MOE, "moe", 4))
    dense_layers = 8 * sum(kind_flops(DENSE, "dense", 4))
    assert math.isclose(
        model_flops_per_iteration(MOE, 4) - model_flops_per_iteration(DENSE, 4), 3 * (moe_layers - dense_layers)
    )
