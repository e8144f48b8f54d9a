"""Placement agreement: chunk_layouts vs megatron's own layer split and first/last-stage answers."""

from __future__ import annotations

import itertools
from typing import Any
from unittest import mock

import pytest

from megatron_pp_ext.integration import layout
from megatron_pp_ext.runtime.layer_map import chunk_layouts
from megatron_pp_ext.schedules.layer_split import LayerSplit
from megatron_pp_ext.schedules.placement import bidirectional_placement, loop_placement, v_placement

NUM_LAYERS = 8


class FakeGroup:
    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


@pytest.fixture
def mpu(megatron: Any) -> Any:
    """megatron's parallel_state with settable pipeline rank / sizes, restored afterwards."""
    from megatron.core import parallel_state as ps

    saved = (
        ps._MPU_PIPELINE_MODEL_PARALLEL_RANK,
        ps._MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE,
        ps._VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE,
    )
    layout.deactivate()
    yield ps
    layout.deactivate()
    (
        ps._MPU_PIPELINE_MODEL_PARALLEL_RANK,
        ps._MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE,
        ps._VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE,
    ) = saved


def set_rank(ps: Any, rank: int, p: int, v: int | None) -> None:
    ps._MPU_PIPELINE_MODEL_PARALLEL_RANK = rank
    ps._MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = p
    ps._VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = v


def transformer_config(p: int, v: int | None) -> Any:
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=NUM_LAYERS,
        hidden_size=16,
        num_attention_heads=2,
        pipeline_model_parallel_size=p,
        virtual_pipeline_model_parallel_size=v,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
    )


def megatron_answers(ps: Any, config: Any, p: int, v: int | None) -> dict[tuple[int, int], tuple[Any, ...]]:
    """Every question megatron asks about a chunk, through the module attributes megatron calls."""
    from megatron.core.pipeline_parallel import utils
    from megatron.core.transformer import transformer_block, transformer_layer

    answers = {}
    # megatron's group helpers answer rank 0 / size 1 unless torch.distributed is initialised
    with mock.patch("torch.distributed.is_initialized", return_value=True):
        for rank, chunk in itertools.product(range(p), range(v or 1)):
            set_rank(ps, rank, p, v)
            vp = chunk if v else None
            group = FakeGroup(rank, p)
            answers[(rank, chunk)] = (
                transformer_layer.get_transformer_layer_offset(config, vp),
                transformer_block.get_num_layers_to_build(config, vp),
                utils.is_vp_first_stage(vp, v) and utils.is_pp_first_stage(group),
                utils.is_vp_last_stage(vp, v) and utils.is_pp_last_stage(group),
                ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp),
                ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp),
                ps.is_pipeline_first_stage(),
                ps.is_pipeline_last_stage(),
            )
    return answers


def expected_answers(placement: Any, p: int, split: Any = None) -> dict[tuple[int, int], tuple[Any, ...]]:
    answers = {}
    for rank in range(p):
        layouts = chunk_layouts(placement, NUM_LAYERS, rank, split)
        for c in layouts:
            answers[(rank, c.chunk)] = (
                c.layer_offset,
                c.num_layers,
                c.pre_process,
                c.post_process,
                c.pre_process,
                c.post_process,
                any(x.pre_process for x in layouts),
                any(x.post_process for x in layouts),
            )
    return answers


@pytest.mark.parametrize(("p", "v"), [(2, 1), (2, 2), (4, 1), (4, 2)])
def test_megatron_agrees_with_chunk_layouts_for_loop_placement(mpu: Any, p: int, v: int) -> None:
    vp = v if v > 1 else None
    config = transformer_config(p, vp)
    placement = loop_placement(p, v)
    assert megatron_answers(mpu, config, p, vp) == expected_answers(placement, p)
    for rank in range(p):
        assert layout.megatron_chunk_layouts(config, rank) == chunk_layouts(placement, NUM_LAYERS, rank)


@pytest.mark.parametrize(("p", "v"), [(2, 1), (2, 2), (4, 1), (4, 2)])
def test_hooks_reproduce_megatron_for_loop_placement(mpu: Any, p: int, v: int) -> None:
    vp = v if v > 1 else None
    config = transformer_config(p, vp)
    own = megatron_answers(mpu, config, p, vp)
    layout.activate(loop_placement(p, v), NUM_LAYERS)
    assert megatron_answers(mpu, config, p, vp) == own
    layout.deactivate()
    assert megatron_answers(mpu, config, p, vp) == own


@pytest.mark.parametrize("p", [2, 4])
def test_hooks_make_megatron_follow_a_v_placement(mpu: Any, p: int) -> None:
    config = transformer_config(p, 2)
    placement = v_placement(p)
    layout.activate(placement, NUM_LAYERS)
    assert megatron_answers(mpu, config, p, 2) == expected_answers(placement, p)
    # rank 0 holds the embedding (chunk 0) and the loss (chunk 1)
    set_rank(mpu, 0, p, 2)
    assert [(c.pre_process, c.post_process) for c in layout.chunk_layouts_for_this_rank()] == [
        (True, False),
        (False, True),
    ]
    assert layout.chunk_is_first_last(1) == (False, True)
    assert layout.get_embedding_ranks([10 + r for r in range(p)]) == [10]
    assert layout.get_position_embedding_ranks([10 + r for r in range(p)]) == [10]
    assert layout.loss_pp_rank(placement) == 0
    # megatron's own first/last-rank logic comes back on deactivate
    layout.deactivate()
    assert layout.get_embedding_ranks([10, 11]) == [10, 11]


def test_hooks_split_layers_of_two_replicas(mpu: Any) -> None:
    p = 2
    config = transformer_config(p, 4)
    placement = bidirectional_placement(p)
    layout.activate(placement, NUM_LAYERS)
    answers = megatron_answers(mpu, config, p, 4)
    assert answers == expected_answers(placement, p)
    assert {a[1] for a in answers.values()} == {NUM_LAYERS // (2 * p)}
    # each replica's embedding and loss: first stages on ranks 0 (down) and p-1 (up)
    assert layout.get_position_embedding_ranks([0, 1]) == [0, 1]


@pytest.mark.parametrize(
    "split", [LayerSplit(first=5), LayerSplit(first=2, last=4), LayerSplit.from_layout("E|ttttt|tt|tL")], ids=str
)
@pytest.mark.parametrize("placement", [v_placement(2), bidirectional_placement(2)], ids=lambda p: p.style)
def test_hooks_build_an_uneven_split_of_v_and_bidirectional_placements(mpu: Any, placement: Any, split: Any) -> None:
    config = transformer_config(2, placement.chunks_per_rank)
    layout.activate(placement, NUM_LAYERS, split)
    answers = megatron_answers(mpu, config, 2, placement.chunks_per_rank)
    assert answers == expected_answers(placement, 2, split)
    assert len({a[1] for a in answers.values()}) > 1  # really uneven


def test_activate_rejects_an_uneven_split(mpu: Any) -> None:
    with pytest.raises(ValueError, match="--num-layers 6"):
        layout.activate(v_placement(2), 6)
    assert layout.active() is None


class FakeChunk:
    def __init__(self, value: float, tied: bool = True) -> None:
        import torch

        self.weight = torch.full((3, 2), value)
        self.share_embeddings_and_output_weights = tied

    def shared_embedding_or_output_weight(self) -> Any:
        return self.weight


class Wrapper:
    def __init__(self, module: Any) -> None:
        self.module = module


def test_tied_output_layer_gets_the_local_embedding(mpu: Any) -> None:
    layout.activate(v_placement(2), NUM_LAYERS)
    # rank 0 holds the embedding (chunk 0) and the output layer (chunk 1): copied locally
    set_rank(mpu, 0, 2, 2)
    embedding, output = FakeChunk(1.5), FakeChunk(0.0)
    layout.tie_local_embeddings([Wrapper(Wrapper(embedding)), Wrapper(output)])
    assert output.weight.eq(1.5).all() and embedding.weight.eq(1.5).all()
    # untied models and ranks without both ends are left alone
    untied = FakeChunk(0.0, tied=False)
    layout.tie_local_embeddings([FakeChunk(2.0), untied])
    assert untied.weight.eq(0.0).all()
    set_rank(mpu, 1, 2, 2)
    middle = [FakeChunk(3.0), FakeChunk(0.0)]
    layout.tie_local_embeddings(middle)
    assert middle[1].weight.eq(0.0).all()
