"""Megatron-Bridge (integration/bridge.py), without Bridge: its schedule-calling modules as stand-ins
(``bridge_standin/train.py`` and ``eval.py`` mirror megatron-bridge 0.6.2's ``training/train.py`` and
``training/eval.py``), its ``ConfigContainer`` as a namespace with the 0.6.2 field names (``training/config.py``:
``model``, ``train``, ``validation``, ``ddp``, ``data_parallel_size``)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
from bridge_standin import MIRRORS, load

from megatron_pp_ext.integration import bridge
from megatron_pp_ext.integration.config import PipelineArgumentError


def bridge_cfg(**model: Any) -> SimpleNamespace:
    """A ConfigContainer-shaped namespace: a GPT provider's fields in ``model`` (a TransformerConfig there)."""
    fields = {
        "num_layers": 8,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "seq_length": 64,
        "vocab_size": 256,
        "pipeline_model_parallel_size": 2,
        "tensor_model_parallel_size": 1,
        "context_parallel_size": 1,
        "virtual_pipeline_model_parallel_size": None,
        "share_embeddings_and_output_weights": True,
        "cuda_graph_impl": "none",
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        **model,
    }
    return SimpleNamespace(
        model=SimpleNamespace(**fields),
        train=SimpleNamespace(micro_batch_size=1, global_batch_size=8, rampup_batch_size=None),
        validation=SimpleNamespace(eval_iters=2, eval_global_batch_size=4, eval_micro_batch_size=1),
        ddp=SimpleNamespace(use_distributed_optimizer=True),
        data_parallel_size=1,
    )


@pytest.fixture
def standins(megatron: Any) -> Iterator[dict[str, ModuleType]]:
    """Bridge's train/eval stand-ins loaded under Bridge's module names; removed afterwards."""
    from megatron_pp_ext.integration import install as inst

    inst.uninstall()
    loaded = {"train": load("train.py")}
    try:
        yield loaded
    finally:
        bridge.uninstall()
        for name in MIRRORS.values():
            sys.modules.pop(name, None)


def test_the_config_maps_onto_the_typed_entry() -> None:
    config = bridge.from_bridge_config(bridge_cfg(), "v-half")
    run = config.run
    assert (run.num_layers, run.pipeline_model_parallel_size, run.micro_batch_size, run.global_batch_size) == (
        8,
        2,
        1,
        8,
    )
    assert (run.eval_iters, run.eval_global_batch_size, run.use_distributed_optimizer) == (2, 4, True)
    assert run.untie_embeddings_and_output_weights is False and config.pipeline_parallel_size == 2
    from megatron_pp_ext.integration.entry import resolve

    resolved, _ = resolve(config)  # the evaluation's micro-batch count (4) is checked too
    assert resolved.num_virtual_stages == 2


@pytest.mark.parametrize(
    ("model", "field"),
    [
        ({"dist_train": SimpleNamespace(use_dist_train=True)}, "model.dist_train.use_dist_train"),
        ({"teacher": SimpleNamespace(num_layers=8)}, "model.teacher"),
        ({"cuda_graph_impl": "full_iteration"}, "model.cuda_graph_impl"),
        ({"cuda_graph_impl": "local", "cuda_graph_modules": ["full_iteration"]}, "model.cuda_graph_impl"),
    ],
)
def test_what_bridge_bypasses_is_refused_in_one_line_naming_the_field(model: dict[str, Any], field: str) -> None:
    with pytest.raises(PipelineArgumentError) as info:
        bridge.from_bridge_config(bridge_cfg(**model), "zb-h1")
    text = str(info.value)
    assert text.startswith(f"ConfigContainer.{field}: ") and "\n" not in text


def test_fsdp_and_multimodule_models_are_refused() -> None:
    with pytest.raises(PipelineArgumentError, match=r"argument --pipeline-fsdp: .* Megatron-Bridge never calls"):
        bridge.from_bridge_config(bridge_cfg(), "bfs", fsdp=True)
    cfg = bridge_cfg()
    cfg.model = type("MegatronMIMOProvider", (), dict(vars(cfg.model)))()
    with pytest.raises(PipelineArgumentError, match=r"^ConfigContainer\.model: MegatronMIMOProvider is a multimodule"):
        bridge.from_bridge_config(cfg, "zb-h1")
    assert bridge.refusal(bridge_cfg(cuda_graph_impl="local", cuda_graph_modules=["attn"])) is None  # per-layer


def test_install_replaces_bridges_by_name_copies_and_sets_the_chunks(standins: dict[str, ModuleType]) -> None:
    from megatron.core.pipeline_parallel import schedules

    original = schedules.get_forward_backward_func
    train = standins["train"]
    assert train.get_forward_backward_func is original
    cfg = bridge_cfg()
    func = bridge.install(cfg, "v-half")
    assert func is not None and cfg.model.virtual_pipeline_model_parallel_size == 2
    assert train.get_forward_backward_func is schedules.get_forward_backward_func is not original  # loaded before
    evaluation = load("eval.py")  # imported after install: picks the replacement up by name
    assert evaluation.get_forward_backward_func is schedules.get_forward_backward_func
    assert train.get_forward_backward_func(pp_size=2, vp_size=2) is func
    with pytest.raises(RuntimeError, match=r"Megatron-Bridge called megatron's 1F1B directly .* v-half: refused"):
        train.forward_backward_pipelining_without_interleaving(forward_step_func=None)
    bridge.uninstall()
    assert train.get_forward_backward_func is original and evaluation.get_forward_backward_func is original
    direct = schedules.forward_backward_pipelining_without_interleaving
    assert train.forward_backward_pipelining_without_interleaving is direct


def test_the_placements_embedding_ranks_reach_megatrons_group_setup(standins: dict[str, ModuleType]) -> None:
    bridge.install(bridge_cfg(), "v-half")  # V: rank 0 holds the embedding and the loss
    seen: dict[str, Any] = {}
    wrapped = bridge._with_placement_ranks(lambda **kwargs: seen.update(kwargs))
    wrapped(pipeline_model_parallel_size=2, get_embedding_ranks=None, get_position_embedding_ranks=None)
    assert seen["get_embedding_ranks"]([10, 11]) == [10] and seen["get_position_embedding_ranks"]([10, 11]) == [10]
    mine = seen.clear() or (lambda ranks, *_: ranks)
    wrapped(get_embedding_ranks=mine)
    assert seen["get_embedding_ranks"] is mine  # the caller's own stays


def test_bridges_stage_builder_gets_the_tied_embedding_copy(
    standins: dict[str, ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    from megatron_pp_ext.integration import layout

    provider = ModuleType(bridge.BRIDGE_BUILDER[0])
    chunks = [object(), object()]
    provider.get_model = lambda *args, **kwargs: chunks  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, bridge.BRIDGE_BUILDER[0], provider)
    tied: list[Any] = []
    monkeypatch.setattr(layout, "tie_local_embeddings", tied.append)
    bridge.install(bridge_cfg(), "v-zb")
    assert provider.get_model() is chunks and tied == [chunks]
    bridge.uninstall()
    provider.get_model()
    assert tied == [chunks]  # unhooked
