"""plan's up-front search limit: the estimate counts what the search does (builds once per memo key, an
extrapolated build's short anchor runs, zeropp's scan per op, every evaluation per shape), an over-limit search is
refused before any schedule is built, and the plan examples of README.md and docs/planner.md are admitted."""

from __future__ import annotations

import shlex
from dataclasses import replace
from pathlib import Path

import pytest

from megatron_pp_ext.cli import main
from megatron_pp_ext.cli.main import build_parser
from megatron_pp_ext.planner import Planner, SearchSpace, search
from megatron_pp_ext.planner.cost_model import CostModel, get_device
from megatron_pp_ext.planner.memory import TrainingSetup
from megatron_pp_ext.planner.models import get_model
from megatron_pp_ext.planner.options import planner_from_args

ROOT = Path(__file__).resolve().parents[2]
W = search.EVALUATION_WEIGHT  # the tiny model has equal dense layers: no per-layer costs
OVERHEAD = search.BUILD_OVERHEAD


def _tiny(gpus: int, batch: int, **space: object) -> Planner:
    spec = get_model("tiny")
    cost = CostModel(spec, get_device("A100-80GB"), TrainingSetup())
    return Planner(spec, gpus, batch, cost, space=SearchSpace(**space))  # type: ignore[arg-type]


def test_a_build_shared_by_two_shapes_is_built_once_and_evaluated_twice() -> None:
    """1f1b on 4 GPUs at global batch 8, PP 2, TP 1 or 2, micro-batch 1 or 2: shapes (TP, DP, b, m) = (1, 2, 1, 4),
    (1, 2, 2, 2), (2, 1, 1, 8), (2, 1, 2, 4). A 1f1b build is 3 x p x m = 6m ops (a linear generator: factor 1), plus
    the per-build overhead: builds at m = 4 (shared), 2 and 8 count once each; evaluations count the m = 4 build at both
    its shapes: 2 x 24 + 12 + 48 = 108 ops."""
    planner = _tiny(4, 8, schedules=("1f1b",), tp=(1, 2), pp=(2,), micro_batch=(1, 2), recompute=("none",))
    assert [s[:4] for s in planner.shapes()] == [(1, 2, 2, 1), (1, 2, 2, 2), (2, 2, 1, 1), (2, 2, 1, 2)]
    builds = 24 + 12 + 48 + 3 * OVERHEAD
    assert planner.search_cost() == (builds, round(W * 108))


def test_an_extrapolated_build_counts_its_anchors_not_m() -> None:
    """p = 2, m = 128: the anchors are m0 = 2p = 4, 6 and 8, so 6 x (4 + 6 + 8) = 108 ops of builds, not 6 x 128;
    each evaluated per recompute setting (2) at its one shape (1f1b has no FSDP: --fsdp both adds nothing)."""
    space = {"tp": (1,), "pp": (2,), "micro_batch": (1,), "recompute": ("none", "full"), "fsdp": (False, True)}
    planner = _tiny(2, 128, schedules=("1f1b",), **space)
    builds = 24 + 36 + 48 + 3 * OVERHEAD
    assert planner.search_cost() == (builds, round(W * 2 * 108))


def test_fsdp_evaluations_weigh_their_data_parallel_stream() -> None:
    """The tiny model untied, 4 GPUs at global batch 8, PP 2, TP 1, DP 2, m = 4: bfs at v = 1 and 2 (24 + 48 ops)
    is evaluated without and with FSDP (0.06 + 0.6 per op), 1f1b (24 ops) without only: 72 x 0.66 + 24 x 0.06."""
    spec = replace(get_model("tiny"), untie_embeddings_and_output_weights=True)
    cost = CostModel(spec, get_device("A100-80GB"), TrainingSetup())
    space = SearchSpace(
        schedules=("bfs", "1f1b"),
        tp=(1,),
        pp=(2,),
        micro_batch=(1,),
        recompute=("none",),
        virtual=(2,),
        fsdp=(False, True),
    )
    planner = Planner(spec, 4, 8, cost, space=space)
    assert (search.EVALUATION_WEIGHT, search.FSDP_EVALUATION_WEIGHT) == (0.06, 0.6)
    builds = 24 + 48 + 24 + 3 * OVERHEAD
    assert planner.search_cost() == (builds, round(72 * 0.66 + 24 * 0.06))


def test_zeropp_unit_builds_weigh_their_scan() -> None:
    """zeropp, p = 2, m = 4, chunks 1 and 2 (the tiny model's 4 layers split over 2 x v stages for v <= 2), unit
    sizes 1 and 2 besides its default U = m = 4: a build is 3 x 2 x v x 4 = 24v ops, weighted by
    1 + p / 40 + p / (5U) = 1.15 (U = 4), 1.45 (U = 1), 1.25 (U = 2): round(27.6) + round(34.8) + 30 = 93 for v = 1,
    round(55.2) + round(69.6) + 60 = 185 for v = 2, and six per-build overheads; evaluations count the plain ops,
    24 x 3 + 48 x 3 = 216."""
    assert (search.UNIT_RANKS, search.UNIT_WINDOW) == (40, 5)
    planner = _tiny(
        2, 4, schedules=("zeropp",), tp=(1,), pp=(2,), micro_batch=(1,), recompute=("none",), unit_sizes=(1, 2)
    )
    assert planner.search_cost() == (93 + 185 + 6 * OVERHEAD, round(W * 216))


def test_layer_split_search_counts_every_layout() -> None:
    """With ``--layer-split search`` a candidate is evaluated under the uniform split and up to 4 planned layouts,
    each sized and timed from per-layer costs (the heavier evaluation weight): 1f1b at p = 2, m = 8 is one build of
    48 ops, evaluated 2 (recompute) x 5 (layouts) times."""
    space = {"tp": (1,), "pp": (2,), "micro_batch": (1,), "recompute": ("none", "full"), "layer_split": "search"}
    planner = _tiny(2, 8, schedules=("1f1b",), **space)
    assert planner.layouts_per_candidate() == 5
    assert planner.search_cost() == (48 + OVERHEAD, round(search.PER_LAYER_EVALUATION_WEIGHT * 10 * 48))


def test_an_over_limit_search_is_refused_before_any_schedule_is_built(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's 64-GPU search without --tp (zeropp at p = 64, m = 512 on every unit size) is over the limit:
    one line with the estimate, the limit and its measured cost, and no schedule built."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the search started")

    monkeypatch.setattr(search.Planner, "build", refuse)
    argv = shlex.split(
        "plan --num-layers 48 --hidden-size 6144 --num-attention-heads 48 --seq-length 2048 --gpus 64 "
        "--global-batch 512 --device H100-80GB --distributed-optimizer --no-cache"
    )
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the search would cost about" in err[0], err
    assert f"the limit is {search.MAX_SEARCH_OPS:,} ({search.LIMIT_COST})" in err[0]


def _plan_examples() -> list[tuple[str, list[str]]]:
    """Every ``megatron-pp plan`` command of README.md and docs/planner.md (continuation lines joined, comments
    dropped) that runs a search."""
    out = []
    for doc in ("README.md", "docs/planner.md"):
        text = (ROOT / doc).read_text().replace("\\\n", " ")
        for line in text.splitlines():
            if not line.strip().startswith("megatron-pp plan --"):  # not "megatron-pp plan | grid | ..."
                continue
            words = shlex.split(line, comments=True)
            if words[:2] != ["megatron-pp", "plan"] or {"--moe-report", "--list-models"} & set(words):
                continue
            out.append((doc, words[1:]))
    return out


def test_the_documented_plan_examples_are_admitted() -> None:
    examples = _plan_examples()
    assert len(examples) >= 6  # both docs' examples were found
    parser = build_parser()
    for doc, argv in examples:
        planner = planner_from_args(parser.parse_args(argv))
        assert planner.search_ops() <= search.MAX_SEARCH_OPS, (doc, " ".join(argv), planner.search_ops())
