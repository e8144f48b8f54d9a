"""scripts/pretrain_gpt.py's command-line pre-check (megatron_pp_ext.integration.argv_check) on a stand-in
parser: one message per problem, unknown flags with the closest known one, bad values by flag."""

from __future__ import annotations

import argparse

from megatron_pp_ext.integration.argv_check import _CollectingParser, argv_problems


def _parser() -> argparse.ArgumentParser:
    p = _CollectingParser(allow_abbrev=False, add_help=False)
    p.add_argument("--num-layers", type=int)
    p.add_argument("--pipeline-schedule", choices=("1f1b", "zb-h1"))
    p.add_argument("--pipeline-memory-limit")
    p.add_argument("--bf16", action="store_true")
    return p


def test_clean_command_line_has_no_problem() -> None:
    assert argv_problems(["--num-layers", "4", "--pipeline-schedule", "zb-h1", "--bf16"], _parser) == []
    assert argv_problems(["--help", "--nonsense"], _parser) == []  # megatron prints its help


def test_every_problem_is_one_line() -> None:
    argv = ["--num-layers", "x", "--pipline-memory-limit=2p", "--pipeline-schedule", "zb-h3", "--bf17", "stray"]
    problems = argv_problems(argv, _parser)
    assert len(problems) == 4, problems
    assert any("--num-layers" in p and "invalid int value: 'x'" in p for p in problems)
    assert any("--pipeline-schedule" in p and "invalid choice: 'zb-h3'" in p for p in problems)
    assert "unknown flag --pipline-memory-limit (did you mean --pipeline-memory-limit?)" in problems
    assert "unknown flag --bf17 (did you mean --bf16?)" in problems


def test_value_of_an_unknown_flag_is_not_a_second_problem() -> None:
    assert argv_problems(["--pipline-schedule", "zb-h1"], _parser) == [
        "unknown flag --pipline-schedule (did you mean --pipeline-schedule?)"
    ]


def test_layers_megatron_cannot_split_over_a_loop_placement_are_one_line() -> None:
    """megatron's validate_args asserts (a traceback) when --num-layers does not divide by the pipeline size;
    under a loop-placement schedule the pre-check says so first, in one line naming --num-layers."""
    from megatron_pp_ext.integration.argv_check import layer_split_problems

    base = ["--pipeline-model-parallel-size", "2", "--num-layers", "5"]
    (problem,) = layer_split_problems([*base, "--pipeline-schedule", "zb-h1"])
    assert problem.startswith("argument --num-layers: 5 layers do not split evenly over --pipeline-model-parallel")
    assert "give a multiple of 2" in problem and "\n" not in problem
    assert layer_split_problems([*base, "--pipeline-schedule", "auto"])  # decided after megatron's checks
    assert (
        layer_split_problems(
            [
                "--pipeline-model-parallel-size",
                "2",
                "--num-layers",
                "5",
                "--pipeline-schedule",
                "1f1b",
                "--account-for-loss-in-pipeline-split",
            ]
        )
        == []
    )  # 5 + 1 splits
    assert layer_split_problems([*base, "--pipeline-schedule", "v-zb"]) == []  # V: the plugin splits its stages
    assert layer_split_problems(base) == []  # megatron's own schedule: megatron's own message
    assert (
        layer_split_problems([*base, "--pipeline-schedule", "zb-h1", "--decoder-first-pipeline-num-layers", "2"]) == []
    )
