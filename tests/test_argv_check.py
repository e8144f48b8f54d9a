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
