"""Megatron's uneven-split flags under V and bidirectional placements: the mapping onto the placement's model
stages and the one-line refusals where none exists (pure: no megatron, no process group)."""

from __future__ import annotations

import sys

import pytest
from megatron_args_helpers import make_args

from megatron_pp_ext.integration.arguments import validate_arguments, validate_arguments_or_exit
from megatron_pp_ext.integration.config import PipelineArgumentError
from megatron_pp_ext.runtime.layer_map import chunk_layouts
from megatron_pp_ext.schedules.layer_split import LayerSplit, LayerSplitError, stage_layer_counts
from megatron_pp_ext.schedules.placement import bidirectional_placement, v_placement
from megatron_pp_ext.schedules.values import parse_layer_layout


def error_of(args: object) -> str:
    with pytest.raises(PipelineArgumentError) as info:
        validate_arguments(args)
    return str(info.value)


def test_layout_strings_parse_like_megatrons() -> None:
    assert parse_layer_layout("Et|(tt|)*2,tL") == ("Et", "tt", "tt", "tL")
    assert parse_layer_layout("Et*3|t|L") == ("Ettt", "t", "L")
    assert parse_layer_layout("E|(t|)*2tL") == ("E", "t", "t", "tL")
    for bad in ("Ex|tL", "", "(t)*1000001"):
        with pytest.raises(ValueError):
            parse_layer_layout(bad)


def test_a_layout_maps_onto_the_model_stages_in_order() -> None:
    split = LayerSplit.from_layout("Et|ttt|t|tL")
    assert stage_layer_counts(6, 4, split) == [1, 3, 1, 1]
    # V at p = 2: rank 0 holds model stages 0 and 3, rank 1 stages 1 and 2
    rank0 = chunk_layouts(v_placement(2), 6, 0, split)
    assert [(c.layer_offset, c.num_layers, c.pre_process, c.post_process) for c in rank0] == [
        (0, 1, True, False),
        (5, 1, False, True),
    ]
    # bidirectional: both replicas hold the same model stages
    for rank in range(2):
        layouts = chunk_layouts(bidirectional_placement(2), 6, rank, split)
        assert sorted((c.replica, c.model_slice, c.num_layers) for c in layouts) == sorted(
            (r, s, [1, 3, 1, 1][s]) for r in range(2) for s in range(4) if (r, s) in _stages_of(rank)
        )


def _stages_of(rank: int) -> set[tuple[int, int]]:
    placement = bidirectional_placement(2)
    return {(placement.replica_of(s), placement.model_slice_of(s)) for s in placement.stages_on_rank(rank)}


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ("Et|tt|tL", "has 3 stage(s); this schedule's placement has 4 model stages"),
        ("t|Ett|t|tL", "needs E once, in the first stage, and L once, in the last"),
        ("Et|tL|t|tL", "needs E once, in the first stage, and L once, in the last"),
        ("Et|tt|t|ttL", "holds 6 transformer layer(s) (t), --num-layers is 5"),
        ("Etm|t|t|tL", "megatron places multi-token prediction layers (m) after every transformer layer (t)"),
    ],
)
def test_layouts_without_a_mapping_are_refused(layout: str, message: str) -> None:
    with pytest.raises(LayerSplitError, match=message.replace("(", r"\(").replace(")", r"\)")):
        stage_layer_counts(5, 4, LayerSplit.from_layout(layout))


@pytest.mark.parametrize("schedule", ["v-half", "v-zb", "dualpipev", "bitpipe"])
def test_first_stage_flag_is_per_model_stage(schedule: str) -> None:
    # 7 layers, first stage 1: 4 model stages [1, 2, 2, 2] (megatron's own check would want 1 divisible by v)
    args = make_args(["--pipeline-schedule", schedule], pipeline_model_parallel_size=2, num_layers=7, **{FIRST: 1})
    config = validate_arguments(args)
    assert args.pipeline_layer_split == LayerSplit(first=1)
    assert stage_layer_counts(7, 4, config.layer_split) == [1, 2, 2, 2]
    assert args.virtual_pipeline_model_parallel_size == (4 if schedule == "bitpipe" else 2)


@pytest.mark.parametrize(("schedule", "chunks"), [("v-half", 2), ("bitpipe", 4)])
def test_layout_flag_sets_the_placements_chunks_not_megatrons(schedule: str, chunks: int) -> None:
    # megatron derived 4 stages / p = 2 virtual stages from the string when it saw it; the placement decides
    args = make_args(
        ["--pipeline-schedule", schedule],
        pipeline_model_parallel_size=2,
        num_layers=5,
        pipeline_model_parallel_layout="Et|tt|t|tL",
        virtual_pipeline_model_parallel_size=2,
    )
    config = validate_arguments(args)
    assert stage_layer_counts(5, 4, config.layer_split) == [1, 2, 1, 1]
    assert args.virtual_pipeline_model_parallel_size == chunks


LAYOUT, FIRST = "pipeline_model_parallel_layout", "decoder_first_pipeline_num_layers"
LAYOUT_FLAG = "--pipeline-model-parallel-layout"
V_HALF, AUTO = ["--pipeline-schedule", "v-half"], ["--pipeline-schedule", "auto", "--pipeline-memory-budget", "10"]


@pytest.mark.parametrize(
    ("argv", "megatron", "flag", "words"),
    [
        (V_HALF, {FIRST: 1}, "--decoder-first-pipeline-num-layers", ["--pipeline-schedule v-half", "--num-layers 7"]),
        (["--pipeline-schedule", "v-zb"], {LAYOUT: "Et|ttt|tL"}, LAYOUT_FLAG, ["--pipeline-schedule v-zb", "4 stages"]),
        (V_HALF, {LAYOUT: "Et|tt|t|tL", FIRST: 1}, LAYOUT_FLAG, ["--decoder-first-pipeline-num-layers", "one or the"]),
        (["--pipeline-schedule", "1f1b"], {LAYOUT: "Ett|ttL", "decoder_last_pipeline_num_layers": 2}, LAYOUT_FLAG,
         ["--decoder-last-pipeline-num-layers"]),
        (V_HALF, {LAYOUT: "Et|tt|t|tL", "num_virtual_stages_per_pipeline_rank": 2}, LAYOUT_FLAG,
         ["--num-virtual-stages-per-pipeline-rank", "leave the virtual flag out"]),
        (AUTO, {LAYOUT: "Et|tt|t|tL"}, LAYOUT_FLAG, ["--pipeline-schedule auto", "--decoder-first/last"]),
    ],
)  # fmt: skip
def test_refusals_are_one_line_naming_both_flags(
    capsys: pytest.CaptureFixture[str], argv: list[str], megatron: dict, flag: str, words: list[str]
) -> None:
    args = make_args(argv, pipeline_model_parallel_size=2, num_layers=5, **megatron)
    with pytest.raises(SystemExit) as info:
        validate_arguments_or_exit(args, prog="pretrain_gpt.py")
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"pretrain_gpt.py: error: argument {flag}: "), err
    for word in words:
        assert word in err, err


def test_account_for_flags_split_the_model_stages() -> None:
    args = make_args(
        ["--pipeline-schedule", "dualpipev"],
        pipeline_model_parallel_size=2,
        num_layers=6,
        account_for_embedding_in_pipeline_split=True,
        account_for_loss_in_pipeline_split=True,
    )
    config = validate_arguments(args)
    assert stage_layer_counts(6, 4, config.layer_split) == [1, 2, 2, 1]
    assert "multiple of 4" in error_of(
        make_args(
            ["--pipeline-schedule", "dualpipev"],
            pipeline_model_parallel_size=2,
            num_layers=7,
            account_for_embedding_in_pipeline_split=True,
            account_for_loss_in_pipeline_split=True,
        )
    )


@pytest.mark.slow  # imports megatron
def test_megatron_validation_does_not_see_a_layout_of_a_v_schedule(megatron, monkeypatch) -> None:
    """megatron's validate_args would derive v = stages / p from the string (and refuse it at p = 2)."""
    import megatron.training.arguments as megatron_arguments

    from megatron_pp_ext.integration.uneven import megatron_validation_for_placement

    seen = []

    def record(args, *rest) -> None:
        layout, first = args.pipeline_model_parallel_layout, args.decoder_first_pipeline_num_layers
        seen.append((layout, first, args.account_for_loss_in_pipeline_split))

    monkeypatch.setattr(megatron_arguments, "validate_args", record)
    cases = [
        ("v-half", {LAYOUT: "Et|tt|t|tL"}),
        ("bitpipe", {"account_for_loss_in_pipeline_split": True}),
        ("zb-h1", {LAYOUT: "Et|tt|t|tL"}),
    ]
    for schedule, flags in cases:
        args = make_args(["--pipeline-schedule", schedule], pipeline_model_parallel_size=2, **flags)
        before = vars(args).copy()
        with megatron_validation_for_placement():
            megatron_arguments.validate_args(args, {})
        assert vars(args) == before
    # a loop placement's flags are megatron's own; V / bidirectional ones are hidden from its checks
    assert seen == [(None, 0, False), (None, 0, False), ("Et|tt|t|tL", None, False)]


LOOP_LAYOUT = ["--pipeline-model-parallel-layout", "Et|t|t|tL"]  # 4 stages: 2 chunks per rank at PP = 2
NO_OVERLAP, PP = "--no-overlap-p2p-communication", "--pipeline-model-parallel-size"
# (argv, refused): megatron derives its chunks per rank from the layout string (or the virtual flag) of every
# schedule but a V / bidirectional one (whose string it does not see), and asserts on more than one chunk per
# rank at PP = 2 without overlapped p2p, at PP = 1 with it
INTERLEAVING = [
    (["--pipeline-schedule", "interleaved-1f1b", PP, "2", NO_OVERLAP, *LOOP_LAYOUT], True),
    (["--pipeline-schedule", "bfs", PP, "2", NO_OVERLAP, *LOOP_LAYOUT], True),
    ([PP, "2", NO_OVERLAP, *LOOP_LAYOUT], True),  # megatron's own schedule
    ([PP, "2", NO_OVERLAP, "--num-virtual-stages-per-pipeline-rank", "2"], True),
    ([PP, "1", *LOOP_LAYOUT], True),
    (["--pipeline-schedule", "interleaved-1f1b", PP, "2", *LOOP_LAYOUT], False),
    (["--pipeline-schedule", "interleaved-zb", PP, "4", NO_OVERLAP, *LOOP_LAYOUT], False),
    (["--pipeline-schedule", "v-half", PP, "2", NO_OVERLAP, *LOOP_LAYOUT], False),
    (["--pipeline-schedule", "1f1b", PP, "2", NO_OVERLAP, LAYOUT_FLAG, "Ett|ttL"], False),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "refused"), INTERLEAVING)
def test_interleaving_megatron_refuses_is_one_line_before_megatron_parses(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, argv: list[str], refused: bool
) -> None:
    """scripts/pretrain_gpt.py's command-line check (before megatron parses, before any process group): one
    line naming the flag, the pipeline size and what would work, exit status 2; nothing where megatron runs."""
    from megatron_pp_ext.integration import argv_check

    monkeypatch.setattr(argv_check, "argv_problems", lambda argv: [])  # megatron's parser: tested elsewhere
    monkeypatch.setenv("RANK", "0")
    if not refused:
        argv_check.check_argv_or_exit(argv, prog="pretrain_gpt.py")
        assert capsys.readouterr().err == ""
        return
    with pytest.raises(SystemExit) as info:
        argv_check.check_argv_or_exit(argv, prog="pretrain_gpt.py")
    assert info.value.code == 2
    err = capsys.readouterr().err
    flag = "--num-virtual-stages-per-pipeline-rank" if "--num-virtual-stages-per-pipeline-rank" in argv else LAYOUT_FLAG
    assert err.count("\n") == 1 and err.startswith(f"pretrain_gpt.py: error: argument {flag}: "), err
    p = argv[argv.index(PP) + 1]
    assert f"{PP} {p} means" in err and "interleaved chunks per rank" in err
    assert (f"leave out {NO_OVERLAP}" in err) == (NO_OVERLAP in argv), err
    assert f"give {PP} " in err


@pytest.mark.slow  # imports megatron
def test_interleaving_refusals_are_where_megatrons_argument_checks_assert(megatron, monkeypatch) -> None:
    """The same command lines through megatron's own parse_args and validate_args (as scripts/pretrain_gpt.py
    calls them): it asserts exactly where the check above refuses."""
    import megatron.training.arguments as megatron_arguments

    from megatron_pp_ext import add_arguments
    from megatron_pp_ext.integration.argv_check import interleaving_problems
    from megatron_pp_ext.integration.uneven import megatron_validation_for_placement

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    model = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64"]
    model += ["--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size", "8"]
    model += ["--train-iters", "1", "--lr", "1e-4", "--distributed-backend", "gloo", "--transformer-impl", "local"]
    defaults = {"tokenizer_type": "NullTokenizer", "vocab_size": 256, "eval_interval": 1000}
    for argv, refused in INTERLEAVING:
        monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", *model, *argv])
        args = megatron_arguments.parse_args(add_arguments)
        try:
            with megatron_validation_for_placement():
                megatron_arguments.validate_args(args, defaults)
            asserted = False
        except AssertionError:
            asserted = True
        assert asserted == refused == bool(interleaving_problems(argv)), argv


@pytest.mark.parametrize(
    ("schedule", "layout", "accepted"),
    [
        ("1f1b", "Et|tmL", True),  # loop: megatron builds it; m with the loss
        ("v-zb", "Et|t|t|tmL", True),  # V: the last model stage, on rank 0
        ("bitpipe", "Et|t|t|tmL", True),
        ("1f1b", "Etm|L", False),  # megatron's rule: never on the first stage
        ("interleaved-1f1b", "Et|t|tm|L", False),  # an MTP stage before the loss: not with our executor
        ("v-zb", "Et|t|tm|tL", False),  # megatron's rule: after every t
    ],
)
def test_mtp_layouts_under_every_placement(schedule: str, layout: str, accepted: bool) -> None:
    args = make_args(
        ["--pipeline-schedule", schedule],
        pipeline_model_parallel_size=2,
        num_layers=layout.count("t"),
        pipeline_model_parallel_layout=layout,
        mtp_num_layers=1,
    )
    if accepted:
        validate_arguments(args)
    else:
        message = error_of(args)
        assert message.startswith("argument --pipeline-model-parallel-layout:") and "\n" not in message
        assert "multi-token prediction layers (m)" in message
