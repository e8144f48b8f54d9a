"""Rough edges a new user hit trying the README: each example works as written."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from megatron_pp_ext.cli import main

README = Path(__file__).resolve().parents[1] / "README.md"
DOCS = README.parent / "docs"
PAGES = (README, *sorted(DOCS.glob("*.md")))  # the README and the pages it links to


def _readme_commands(prefix: str, pages: tuple[Path, ...] = (README,)) -> list[str]:
    lines = [line.split("#", 1)[0].strip() for page in pages for line in page.read_text().splitlines()]
    return [line for line in lines if line.startswith(prefix)]


def _variants(command: str) -> list[list[str]]:
    """The command without its [optional] parts, and with each of them alone."""
    optional = re.findall(r"\[([^\]]+)\]", command)
    base = shlex.split(re.sub(r"\[[^\]]+\]", "", command))[1:]
    return [base, *[base + shlex.split(opt) for opt in optional]]


@pytest.mark.slow  # runs every simulate / compare example of the README and docs/cli.md: ~2.5 s of CPU
def test_readme_simulate_and_compare_examples_run(capsys: pytest.CaptureFixture[str]) -> None:
    pages = (README, DOCS / "cli.md")  # the README's one screen and the full command reference
    commands = _readme_commands("megatron-pp simulate", pages) + _readme_commands("megatron-pp compare", pages)
    assert any("--memory-limit 2p" in c for c in commands)
    for command in commands:
        for argv in _variants(command):
            assert main(argv) == 0, (argv, capsys.readouterr().err)


def test_compare_has_a_time_column_in_1f1b_stage_units(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", "-p", "4", "-m", "8", "--costs", "1,1,1,0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("schedule "))
    assert header.split()[:3] == ["schedule", "v", "time"]
    times = {line.split()[0]: line.split()[2] for line in lines if line.split() and line.split()[0] in ("1f1b", "v-zb")}
    assert float(times["1f1b"]) == pytest.approx((8 + 4 - 1) * 3)  # (m + p - 1)(F + B + W)
    assert float(times["v-zb"]) < float(times["1f1b"])  # V stages cost half: not 2x slower
    assert sum(line.count(" * ") + line.endswith(" *") for line in lines) >= 1


def test_best_per_schedule_lists_pp1_once_and_not_under_a_schedule(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "zb-1.5b", "--gpus", "8", "--global-batch", "64", "--best-per-schedule",
            "--schedules", "1f1b,zb-h1,gpipe", "--recompute", "none", "--no-cache", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line[:1].isdigit()]
    pp_column = 4  # "#", then the schedule (one word, or "none (pp=1)": two), tp, pp
    for row in rows:
        if row[1] == "none":
            assert row[2] == "(pp=1)" and row[pp_column] == "1"
        else:
            assert row[pp_column - 1] != "1", row  # a pipeline schedule's best row has a pipeline
    assert sum(row[1] == "none" for row in rows) <= 1


def test_launch_local_readme_example_runs_distinct_schedules_with_a_pipeline(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (command,) = _readme_commands("megatron-pp launch-local")
    argv = [a for a in shlex.split(command)[1:] if a != "--collect"]
    argv[argv.index("--out") + 1] = str(tmp_path)
    assert main([*argv, "--dry-run", "--no-cache"]) == 0
    ids = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert len(ids) == 2
    schedules = [i.split("-t")[0] for i in ids]
    assert len(set(schedules)) == 2 and "v-block" not in schedules
    for cid in ids:
        m = int(re.search(r"-b\d+m(\d+)-", cid).group(1))  # type: ignore[union-attr]
        assert m >= 2, cid  # at m = 1 a pipeline schedule has nothing to overlap


def test_list_fits_100_columns(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100
    assert "zb-h1" in out and "constraints:" in out


def test_planner_leaves_v_block_out_unless_asked() -> None:
    """Without a block file v-block is v-half's block: the default search would list the same schedule twice."""
    from megatron_pp_ext.planner.space import default_schedules

    assert "v-block" not in default_schedules() and "v-half" in default_schedules()


def test_readme_commands_run_from_the_checkout_root() -> None:
    """Every command block is run from the checkout's root (scripts/..., scripts/slurm/...): none changes into a
    directory of the checkout first (the Slurm section once began with `cd megatron_pp_ext`, the package)."""
    root = README.parent
    for page in PAGES:
        for line in page.read_text().splitlines():
            command = line.split("#", 1)[0].strip()
            if command.startswith("cd "):
                target = shlex.split(command)[1]
                assert not (root / target).is_dir(), f"{page.name}: {line.strip()!r} enters {target}/ of the checkout"


def test_readme_auto_flags_exist_and_the_example_parses() -> None:
    """The auto flags of the schedules page are the megatron flags and plan's (the example's pretrain flags parse)."""
    from megatron_pp_ext.integration.flags import add_arguments
    from megatron_pp_ext.planner.options import add_plan_arguments

    text = (DOCS / "schedules.md").read_text()
    example = next(line for line in text.splitlines() if "run_tiny_cpu.sh auto 4" in line)
    flags = shlex.split(example.split("run_tiny_cpu.sh auto 4", 1)[1].split("`", 1)[0])
    import argparse

    ours = add_arguments(argparse.ArgumentParser(exit_on_error=False))
    known, rest = ours.parse_known_args(flags)
    assert rest == ["--train-iters", "3"] and known.pipeline_replan and known.pipeline_memory_budget == 4.0
    plan = argparse.ArgumentParser()
    add_plan_arguments(plan)
    assert plan.parse_args(["--overlap", "0.5"]).overlap == 0.5


def test_readme_torchrun_commands_are_complete() -> None:
    """A torchrun command in the README or the docs can be pasted as is: written out in full (the ZeroPP example
    once elided its middle with '...'), and every flag of ours in it is one of our flags."""
    from megatron_pp_ext.integration.flags import add_arguments

    text = "\n".join(page.read_text() for page in PAGES).replace("\\\n", " ")
    commands = [line.strip() for line in text.splitlines() if line.strip().startswith("torchrun ")]
    commands += re.findall(r"`(torchrun [^`]+)`", text)
    assert len(commands) >= 4
    import argparse

    ours = {a for action in add_arguments(argparse.ArgumentParser())._actions for a in action.option_strings}
    for command in commands:
        argv = shlex.split(command.split("#", 1)[0])
        assert "..." not in argv, command
        mine = [a for a in argv if a.startswith("--pipeline-") and not a.startswith("--pipeline-model-parallel")]
        assert all(a in ours for a in mine), command


def test_list_models_fits_100_columns(capsys: pytest.CaptureFixture[str]) -> None:
    """`plan --list-models` was ~330 characters wide (its source and assumption texts in columns)."""
    assert main(["plan", "--list-models"]) == 0
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= 100
    assert "zb-1.5b" in out and "source: Qi et al., Zero Bubble" in out and "assumed: vocab_size" in out
