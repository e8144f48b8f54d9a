"""The layout axis (planner/layer_layouts.py, planner/layout_search.py): the exact min-max partition, the first/last
family, the candidates, megatron's flags and the refusals of a given layout."""

from __future__ import annotations

import itertools
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_pp_ext.planner.cost_model import CostModel, get_device
from megatron_pp_ext.planner.layer_layouts import (
    MAX_CANDIDATES,
    candidate_splits,
    check_layout,
    first_last_split,
    layout_args,
    layout_text,
    min_max_partition,
    rank_loads,
    split_from_layout,
)
from megatron_pp_ext.planner.megatron_args import config_args
from megatron_pp_ext.planner.memory import TrainingSetup
from megatron_pp_ext.planner.models import get_model
from megatron_pp_ext.planner.sbatch import check_tokens
from megatron_pp_ext.planner.search import Planner
from megatron_pp_ext.planner.space import SearchSpace
from megatron_pp_ext.schedules.placement import loop_placement, v_placement
from megatron_pp_ext.schedules.values import parse_layer_layout

ROOT = Path(__file__).resolve().parents[2]


def brute_force(weights: list[float], parts: int) -> float:
    """The smallest largest run over every cut of ``weights`` into ``parts`` non-empty runs."""
    n = len(weights)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), parts - 1):
        bounds = (0, *cuts, n)
        best = min(best, max(sum(weights[a:b]) for a, b in itertools.pairwise(bounds)))
    return best


def runs_max(weights: list[float], sizes: tuple[int, ...]) -> float:
    out, i = [], 0
    for s in sizes:
        out.append(sum(weights[i : i + s]))
        i += s
    return max(out)


@pytest.mark.parametrize("seed", range(6))
def test_min_max_partition_is_exact(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(3, 10)
    weights = [rng.choice((0.5, 1.0, 1.0, 2.0, 3.7)) for _ in range(n)]
    for parts in range(1, n + 1):
        best = brute_force(weights, parts)
        for back in (False, True):
            sizes = min_max_partition(weights, parts, back)
            assert len(sizes) == parts and min(sizes) >= 1 and sum(sizes) == n
            assert runs_max(weights, sizes) == pytest.approx(best)


def test_first_last_family_is_exact_per_rank() -> None:
    """V: rank 0 holds the first and the last slice (embedding and head); the best first/last pair over the
    family (middle slices even) minimises the busiest rank."""
    placement = v_placement(4)
    weights = [0.2] + [1.0] * 14 + [2.5]  # embedding, 14 layers, a head worth 2.5 layers
    (best,) = first_last_split(placement, weights, 1)
    assert sum(best) == 14 and len(set(best[1:-1])) == 1

    def load(split: tuple[int, ...]) -> float:
        per = [sum(weights[1 + sum(split[:i]) : 1 + sum(split[: i + 1])]) for i in range(len(split))]
        per[0] += weights[0]
        per[-1] += weights[-1]
        return max(rank_loads(placement, split, per))

    family = [(f, *(k,) * 6, 14 - 6 * k - f) for k in (1, 2) for f in range(14 - 6 * k + 1)]
    assert load(best) == min(load(s) for s in family)
    assert best[0] + best[-1] < best[1] * 2  # rank 0 gives layers away for the embedding and the head


def test_candidates() -> None:
    placement = loop_placement(4)
    weights = [0.1] + [1.0] * 14 + [3.0]
    cands = candidate_splits(placement, weights, (4, 4, 3, 3))
    assert cands[0] == (4, 4, 3, 3) and 1 < len(cands) <= 1 + MAX_CANDIDATES
    assert all(sum(c) == 14 and min(c[1:-1]) >= 1 for c in cands)
    assert cands[1][-1] < 3  # the head's stage holds fewer layers
    assert candidate_splits(loop_placement(4), [1.0, 1.0, 1.0], None) == []  # 4 stages, 3 items


MEGATRON_CHECK = """
import json, sys
from megatron_pp_ext.integration.cpu import enable_cpu_mode
enable_cpu_mode()
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
out = []
for text, layers in json.loads(sys.argv[1]):
    parsed = PipelineParallelLayerLayout(text, 4)
    parsed.validate_layer_layout(layers, None)
    vpp = parsed.virtual_pipeline_model_parallel_size
    out.append([parsed.layout[i % 4][i // 4].count(LayerType.decoder) for i in range(4 * vpp)])
print(json.dumps(out))
"""


@pytest.mark.slow  # megatron-core's import, in a child process (its CPU shims stay out of this one)
def test_layout_text_is_megatrons() -> None:
    """Megatron reads our layout text as the split it came from (stage i = pipeline rank i % p, chunk i // p)."""
    splits = [(0, 5, 5, 4), (4, 4, 4, 2), (2, 3, 3, 3, 3, 3, 3, 0)]
    cases = [(layout_text(s, compact), sum(s)) for s in splits for compact in (True, False)]
    for text, _ in cases:
        assert [s.count("t") for s in parse_layer_layout(text)] in [list(s) for s in splits]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", MEGATRON_CHECK, json.dumps(cases)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [list(s) for s in splits for _ in (True, False)]


def test_layout_flags() -> None:
    assert layout_args("loop", (1, 2)) == ["--pipeline-model-parallel-layout", "Et|ttL"]
    assert layout_args("v", (0, 2, 2, 1)) == [
        "--decoder-first-pipeline-num-layers",
        "0",
        "--decoder-last-pipeline-num-layers",
        "1",
    ]


@pytest.mark.parametrize(
    "text, placement, match",
    [
        ("Et*4|t*4|t*4|t*3L", loop_placement(4), "holds 15 decoder layers"),
        ("Et*8|t*8||L", loop_placement(4), "stage 2 is empty"),
        ("Et*8|t*8|t*8L", loop_placement(4), "3 stages, the loop placement on 4 ranks"),
        ("t*4|Et*4|t*4|t*4L", loop_placement(4), "stage 1: the embedding E goes once, first in stage 0"),
        ("Et*4|t*4|t*4|t*4", loop_placement(4), "stage 3 must end with the loss L"),
        ("Et*2|t*2|t*3|t*2|t*2|t*2|t*2|tL", v_placement(4), "stage 2: a v placement maps only"),
    ],
)
def test_bad_layouts_name_the_stage(text: str, placement: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        split_from_layout(text, 16, placement)  # type: ignore[arg-type]


def test_given_layout() -> None:
    assert split_from_layout("E|t*8|t*8|L", 16, loop_placement(4)) == (0, 8, 8, 0)
    assert check_layout("Et*2|t*3|t*3|t*2|t*2|t*2|t*2|L", 16) == (2, 3, 3, 2, 2, 2, 2, 0)


def planner(vocab: int, split: str, schedules: tuple[str, ...] = ("1f1b", "zb-h1")) -> Planner:
    model = get_model("zb-6.2b").with_overrides(name="big-vocab", vocab_size=vocab)
    cost = CostModel(model, get_device("A100-80GB"), TrainingSetup())
    space = SearchSpace(
        tp=(1,), pp=(8,), micro_batch=(3,), recompute=("none",), schedules=schedules, layer_split=split, virtual=(1, 2)
    )
    return Planner(model, 8, 96, cost, space=space)


def test_search_plans_layouts_against_the_uniform_split() -> None:
    result = planner(128256, "search").run(progress=False)
    planned = [r for r in result.rows if r.config.layout]
    uniform = [r for r in result.rows if not r.config.layout]
    assert planned and uniform
    for name in ("1f1b", "zb-h1"):
        best_planned = min(r.iteration_time for r in planned if r.config.schedule == name)
        best_uniform = min(r.iteration_time for r in uniform if r.config.schedule == name)
        assert best_planned < 0.95 * best_uniform  # the 128k-vocabulary head is worth ~2.4 layers
    row = planned[0]
    assert row.config.split == check_layout(row.config.layout or "", 30)
    args = config_args(row.config, TrainingSetup(), 96)
    assert "--pipeline-model-parallel-layout" in args and "--num-virtual-stages-per-pipeline-rank" not in args
    assert "--account-for-embedding-in-pipeline-split" not in args
    assert row.to_json_dict()["layout"] == row.config.layout and row.config.id.endswith("-layout")
    check_tokens(args, "a planned configuration")  # the Slurm script passes the layout as one plain word


def test_default_split_policy_unchanged() -> None:
    """Without the layout axis no row has a layout, and the per-stage cost model (no embedding) is used."""
    plain = planner(128256, "auto")
    assert not plain.per_layer
    result = plain.run(progress=False)
    assert result.rows and not any(r.config.layout for r in result.rows)
    args = config_args(result.rows[0].config, TrainingSetup(), 96)
    assert "--pipeline-model-parallel-layout" not in args


def test_planned_rows_beat_their_uniform_row() -> None:
    result = planner(50257, "search", ("1f1b", "zb-h1", "v-zb")).run(progress=False)
    uniform = {r.config.id: r for r in result.rows if not r.config.layout}
    for row in result.rows:
        base = uniform.get(row.config.id.removesuffix("-layout"))
        if row.config.layout and base is not None:
            assert row.iteration_time < base.iteration_time, row.config.id


@pytest.mark.parametrize(
    "layout, message",
    [
        ("Et*8|t*8|t*8|t*5L", "layout holds 29 decoder layers (t), the model has 30"),
        ("Et*10||t*10|t*10L", "layout stage 1 is empty"),
        ("Et*8|t*8|t*8|t*6|", "layout stage 4 is empty"),
        ("Et*8|t*8|x|t*6L", "unknown 'x'"),
    ],
)
def test_cli_refuses_a_bad_layout_in_one_line(layout: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from megatron_pp_ext.cli import main

    args = ["plan", "--model", "zb-6.2b", "--gpus", "8", "--global-batch", "96", "--no-cache", "--layout", layout]
    try:
        code = main(args)
    except SystemExit as exc:  # argparse's own refusal (the syntax)
        code = exc.code  # type: ignore[assignment]
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and "Traceback" not in "\n".join(err)
