"""``plan`` for a hybrid model writes the chosen layout as megatron's ``--hybrid-layer-pattern`` with ``|``
between the stages (planner/layer_layouts.py, planner/megatron_args.py), into the table, the JSON and the Slurm
files."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_pp_ext.planner.cost_model import CostModel, get_device
from megatron_pp_ext.planner.layer_layouts import hybrid_pattern_text
from megatron_pp_ext.planner.megatron_args import config_args
from megatron_pp_ext.planner.memory import TrainingSetup
from megatron_pp_ext.planner.models import get_model
from megatron_pp_ext.planner.plan_report import plan_document, table_rows
from megatron_pp_ext.planner.sbatch import GridOptions, check_tokens
from megatron_pp_ext.planner.search import Planner
from megatron_pp_ext.planner.space import SearchSpace
from megatron_pp_ext.runtime.hybrid_pattern import hybrid_layer_split
from megatron_pp_ext.schedules import registry
from megatron_pp_ext.schedules.placement import make_placement

# megatron-core refuses each of these beside a pattern with '|' (megatron/training/arguments.py)
REFUSED_BESIDE_PIPES = (
    "--num-virtual-stages-per-pipeline-rank",
    "--pipeline-model-parallel-layout",
    "--decoder-first-pipeline-num-layers",
    "--decoder-last-pipeline-num-layers",
    "--account-for-embedding-in-pipeline-split",
    "--account-for-loss-in-pipeline-split",
)


def test_pattern_text_cuts_the_layers() -> None:
    assert hybrid_pattern_text("M-M*-M", (1, 3, 2)) == "M|-M*|-M"
    assert hybrid_pattern_text("M-M*", (4,)) == "M-M*"
    assert hybrid_pattern_text("M-M*", (0, 4)) == "|M-M*"  # a stage of the embedding alone
    with pytest.raises(ValueError, match="does not cut the 4 layers"):
        hybrid_pattern_text("M-M*", (2, 3))


@pytest.fixture(scope="module")
def plan() -> tuple[Planner, list]:
    """The layout search's rows and those of the uniform split (interleaved with its virtual flag among them)."""
    model = get_model("nemotron-h-8b")
    rows = []
    for split in ("auto", "search"):
        space = SearchSpace(
            tp=(2,),
            pp=(2,),
            micro_batch=(1,),
            recompute=("none",),
            schedules=("1f1b", "interleaved-1f1b", "v-zb"),
            virtual=(1, 2, 3),  # interleaved's v=3 is a non-default chunk count: megatron's flag would give it
            layer_split=split,
        )
        planner = Planner(model, 8, 64, CostModel(model, get_device("H100-80GB"), TrainingSetup()), space=space)
        result = planner.run(progress=False)
        assert {r.config.schedule for r in result.rows} == {"1f1b", "interleaved-1f1b", "v-zb"}
        rows += result.rows
    return planner, rows


def test_every_row_carries_the_pattern_of_its_split(plan: tuple[Planner, list]) -> None:
    """Each row's flags: one ``--hybrid-layer-pattern`` whose segments the training run maps back onto the
    row's split under its schedule's placement, and none of the flags megatron refuses beside it."""
    planner, rows = plan
    pattern = planner.model.hybrid_pattern
    assert any(r.config.layout for r in rows) and any(not r.config.layout for r in rows)
    assert any(r.config.v_flag and r.config.chunks > 1 for r in rows)  # a run megatron would give a virtual flag
    for row in rows:
        c = row.config
        args = config_args(c, planner.setup, planner.global_batch, planner.model)
        assert args.count("--hybrid-layer-pattern") == 1, args
        text = args[args.index("--hybrid-layer-pattern") + 1]
        assert text.replace("|", "") == pattern
        assert not set(REFUSED_BESIDE_PIPES) & set(args), args
        placement = make_placement(registry.get(c.schedule).placement, c.pp, c.chunks)
        assert hybrid_layer_split(text, placement, c.schedule).counts == c.split
        assert text.count("|") + 1 == c.pp * c.chunks  # megatron derives the chunks per rank from the segments
        if c.layout:  # a planned layout is shown as the same pattern (table, JSON)
            assert c.layout == text
        check_tokens(args, "a hybrid configuration")  # the Slurm script passes the pattern as one word


def test_table_json_and_slurm(plan: tuple[Planner, list], tmp_path: Path) -> None:
    from megatron_pp_ext.planner.grid import write_grid

    planner, _ = plan
    result = planner.run(progress=False)
    rows = result.rows
    planned = next(r for r in rows if r.config.layout)
    table = table_rows(rows)
    assert planned.config.layout in table[rows.index(planned)]
    doc = plan_document(result, planner, rows)
    entry = doc["rows"][rows.index(planned)]
    assert entry["layout"] == planned.config.layout
    assert entry["megatron_args"][entry["megatron_args"].index("--hybrid-layer-pattern") + 1] == entry["layout"]
    files = write_grid(tmp_path, doc, doc["rows"], GridOptions(gpus_per_node=8))
    assert planned.config.layout in files["configs"].read_text()
    assert "$MPP_REPO/scripts/pretrain_hybrid.py" in files["sbatch"].read_text()


def test_a_dense_model_keeps_its_flags() -> None:
    model = get_model("zb-1.5b")
    planner = Planner(
        model,
        8,
        64,
        CostModel(model, get_device("A100-80GB"), TrainingSetup()),
        space=SearchSpace(tp=(1,), pp=(4,), micro_batch=(1,), recompute=("none",), schedules=("1f1b",)),
    )
    row = planner.run(progress=False).rows[0]
    assert "--hybrid-layer-pattern" not in config_args(row.config, planner.setup, 64, model)
