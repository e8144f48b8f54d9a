"""A ``--ckpt-format torch`` checkpoint under another placement (``checkpoint_layout``, ``checkpoint_mapping``).

For every pair of registered schedules (p = 2 and 4, their default chunks):

* megatron's own load is taken exactly when both place the same layers in the same chunks of every rank,
  whether the checkpoint carries its layout record or only megatron's ``args`` (checkpoints of megatron
  itself or of an earlier version);
* otherwise the weights move: every chunk of every rank gets exactly the entries (the same objects) it
  would have saved itself, and nothing else; what cannot be filled exactly is an error.

The end-to-end runs (``test_checkpoint_reload.py``) show that the record a run writes is the layout
megatron built, that a moved load gives the saving run's next loss bit for bit, and what a refused run prints.
"""

from __future__ import annotations

import io
import itertools
from argparse import Namespace
from functools import cache

import pytest
import torch

from megatron_pp_ext.integration.checkpoint_layout import (
    RECORD_KEY,
    as_record,
    describe,
    mismatch,
    normalise,
    table_from_args,
    table_of_layouts,
)
from megatron_pp_ext.integration.checkpoint_mapping import MappingError, map_chunks
from megatron_pp_ext.runtime.layer_map import chunk_layouts
from megatron_pp_ext.schedules import Placement, generate, names

NUM_LAYERS = 8


@cache
def _placement_of(schedule: str, p: int) -> Placement:
    return generate(schedule, p, 2 * p).placement


def _args(schedule: str | None, p: int, **extra: object) -> Namespace:
    chunks = _placement_of(schedule, p).chunks_per_rank if schedule else None
    return Namespace(
        pipeline_schedule=schedule,
        pipeline_model_parallel_size=p,
        virtual_pipeline_model_parallel_size=chunks if chunks and chunks > 1 else None,
        num_layers=NUM_LAYERS,
        **extra,
    )


def _table(schedule: str, p: int) -> tuple:
    placement = _placement_of(schedule, p)
    return table_of_layouts([chunk_layouts(placement, NUM_LAYERS, r) for r in range(p)])


def _placement(schedule: str, p: int) -> tuple:
    placement = _placement_of(schedule, p)
    return tuple(placement.stages_on_rank(r) for r in range(p))


SCHEDULES = [s for s in names() if s != "auto"]


@pytest.mark.parametrize("p", [2, 4])
def test_megatron_own_load_is_taken_exactly_under_the_same_placement(p: int) -> None:
    refused = accepted = 0
    for saved, loaded in itertools.product(SCHEDULES, repeat=2):
        same = _placement(saved, p) == _placement(loaded, p)
        current = _table(loaded, p)
        with_record = {RECORD_KEY: as_record(_table(saved, p)), "args": _args(saved, p)}
        args_only = {"args": _args(saved, p)}
        for state_dict in (with_record, args_only):
            why = mismatch(state_dict, current, _args(loaded, p))
            assert (why is None) == same, (saved, loaded, why)
        refused += not same
        accepted += same
    assert refused and accepted


def test_megatron_own_schedule_is_the_loop_placement() -> None:
    interleaved = _args(None, 2, pipeline_schedule_file=None)
    interleaved.virtual_pipeline_model_parallel_size = 2
    assert table_from_args(interleaved) == _table("interleaved-1f1b", 2)
    assert table_from_args(_args(None, 2)) == _table("1f1b", 2)
    assert mismatch({"args": _args(None, 2)}, _table("v-half", 2), _args("v-half", 2)) is not None


@pytest.mark.parametrize(
    "extra",
    [{"pipeline_schedule_file": "plan.json"}, {"pipeline_model_parallel_layout": "Et|tL"}],
)
def test_underivable_placement_loads_only_with_the_same_flags(extra: dict[str, object]) -> None:
    saved = _args("1f1b", 2, **extra)
    assert table_from_args(saved) is None
    assert mismatch({"args": saved}, _table("1f1b", 2), _args("1f1b", 2, **extra)) is None
    assert mismatch({"args": saved}, _table("1f1b", 2), _args("1f1b", 2)) is not None
    assert mismatch({}, _table("1f1b", 2), _args("1f1b", 2)) is not None  # nothing to go by


def test_auto_without_record_is_refused() -> None:
    saved = _args("1f1b", 2)
    saved.pipeline_schedule = "auto"
    assert mismatch({"args": saved}, _table("1f1b", 2), saved) is not None


def test_record_loads_weights_only_and_reads_back() -> None:
    table = _table("bitpipe", 2)
    buffer = io.BytesIO()
    torch.save({RECORD_KEY: as_record(table)}, buffer)
    buffer.seek(0)
    assert normalise(torch.load(buffer, weights_only=True)[RECORD_KEY]) == table


def test_describe_names_every_rank_and_chunk() -> None:
    assert describe(_table("1f1b", 2)) == "rank 0 [emb 0-3], rank 1 [4-7 loss]"
    assert describe(_table("v-half", 2)) == "rank 0 [emb 0-1 | 6-7 loss], rank 1 [2-3 | 4-5]"


# ---- moving a torch checkpoint's weights onto another placement (checkpoint_mapping) ----------------
PRE_KEYS = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight")
POST_KEYS = ("decoder.final_layernorm.weight", "output_layer.weight", "output_layer._extra_state")


def _chunk_state(offset: int, count: int, pre: bool, post: bool) -> dict[str, object]:
    """A chunk's state dict as megatron names it; every value says which global entry it is."""
    state: dict[str, object] = {f"decoder.layers.{j}.{name}": (offset + j, name) for j in range(count)
                                for name in ("linear_qkv.weight", "mlp.linear_fc1._extra_state")}  # fmt: skip
    state.update({key: key for key in PRE_KEYS if pre})
    state.update({key: key for key in POST_KEYS if post})
    state["rotary_pos_emb.inv_freq"] = "common"
    return state


@pytest.mark.parametrize("p", [2, 4])
def test_mapping_gives_every_chunk_exactly_its_entries_for_every_pair(p: int) -> None:
    mapped_pairs = 0
    for saved_name, loaded_name in itertools.product(SCHEDULES, repeat=2):
        saved, current = _table(saved_name, p), _table(loaded_name, p)
        files = [[_chunk_state(*chunk) for chunk in chunks] for chunks in saved]
        for rank in range(p):
            want = [_chunk_state(*chunk) for chunk in current[rank]]
            got = map_chunks(files, saved, current, rank, [set(w) for w in want])
            assert got == want, (saved_name, loaded_name, rank)
        mapped_pairs += saved != current
    assert mapped_pairs


def test_mapping_refuses_what_it_cannot_fill_exactly() -> None:
    saved, current = _table("1f1b", 2), _table("v-half", 2)
    files = [[_chunk_state(*chunk) for chunk in chunks] for chunks in saved]
    want = [set(_chunk_state(*chunk)) for chunk in current[0]]
    with pytest.raises(MappingError, match="too few"):
        map_chunks(files, saved, current, 0, [want[0] | {"embedding.extra"}, want[1]])
    del files[1][0]["decoder.layers.3.linear_qkv.weight"]
    files[1][0]["decoder.layers.9.linear_qkv.weight"] = None
    with pytest.raises(MappingError, match="beyond the 4 layer"):
        map_chunks(files, saved, current, 1)
    with pytest.raises(MappingError, match="chunks per rank"):
        map_chunks([files[0], []], saved, current, 0)


def test_a_v_schedules_layout_string_is_derivable() -> None:
    from megatron_pp_ext.schedules.layer_split import LayerSplit

    layout = "E" + "t" * (NUM_LAYERS - 3) + "|t|t|tL"
    saved = _args("v-half", 2, pipeline_model_parallel_layout=layout)
    placement = _placement_of("v-half", 2)
    split = LayerSplit.from_layout(layout)
    assert table_from_args(saved) == table_of_layouts(
        [chunk_layouts(placement, NUM_LAYERS, r, split) for r in range(2)]
    )
    assert table_from_args(saved) != _table("v-half", 2)
