"""One meaning per value: the same text given to ``megatron-pp``, to megatron's ``--pipeline-*`` flags and to
the planner is accepted or refused alike, and means the same number (schedules/values.py); and
docs/flags.md is the table generated from PipelineConfig's flag metadata. Pure and fast: no process group."""

from __future__ import annotations

import argparse

import pytest

from megatron_pp_ext import argtypes
from megatron_pp_ext.integration import flags
from megatron_pp_ext.integration.arguments import config_from_args
from megatron_pp_ext.integration.config import PipelineArgumentError, PipelineConfig
from megatron_pp_ext.integration.flags import add_arguments
from megatron_pp_ext.planner.options import add_plan_arguments
from megatron_pp_ext.planner.variants import resolve_limit
from megatron_pp_ext.schedule_args import CliError, add_source_args, parse_cli_memory_limit
from megatron_pp_ext.schedules.costs import Costs

P = 4
MEMORY_LIMITS = [
    "p", "1p", "2p", "2P", " 3p ", "1.5p", "12", " 3 ", "1.5", "1e3", ".5", "1e12", "p ",
    "0", "0p", "-1", "-1p", "", " ", "x", "2q", "pp", "nan", "inf", "infp", "1_0", "0x10", "1e13", "+2", "2 p",
]  # fmt: skip
COSTS = [
    "1,1,1", "1,2,1,0.5", " 1, 2 ,3, 0.25", "1,1,0", "1,2,0,0", "1e12,1,1", "0.5,1e-3,0,0",
    "0,1,1", "1,0,1", "0,0,0", "1,2", "1,2,3,4,5", "1,x,1", "nan,1,1", "1,1,inf", "1e308,1,1", "-1,1,1",
    "1,1,1,-1", "1,,1", ",,,",
]  # fmt: skip
UNIT_SIZES = ["1", "4", " 2 ", "auto", "AUTO", "0", "-1", "1.5", "x", ""]
LAYER_COSTS = [
    "dense=1,2,1", "dense=1,2,1;head=3,3,2.8;micro_batch=2", " DENSE = 1, 2, 1 ;tp=2;", "mamba=1,1,0;mlp=0,0,0",
    "dence=1,2,1", "dense=1,2", "dense=nan,1,1", "dense=1,2,1e13", "dense=1,2,1;tp=0", "micro_batch=2",
    "dense=1,2,1;x", ";",
]  # fmt: skip


def _megatron(flag: str, text: str) -> object:
    """The value megatron's parser and :func:`config_from_args` give ``flag text``, or ``"refused"``."""
    parser = add_arguments(argparse.ArgumentParser(exit_on_error=False))
    try:
        args = parser.parse_args(["--pipeline-schedule", "zb-auto", f"{flag}={text}"])
        config = config_from_args(args)
    except (argparse.ArgumentError, PipelineArgumentError):
        return "refused"
    return {
        "--pipeline-memory-limit": lambda c: c.memory_limit.resolve(P),
        "--pipeline-costs": lambda c: c.costs,
        "--pipeline-unit-size": lambda c: c.unit_size,
    }[flag](config)


def _verdict(parse, *args: object) -> object:
    try:
        return parse(*args)
    except (CliError, ValueError, argparse.ArgumentTypeError):  # ArgumentTypeError is no ValueError
        return "refused"


def _one(items: tuple[str, ...]) -> str:
    """The planner takes a list of limits; blank text is an empty list, i.e. no limit given."""
    if len(items) != 1:
        raise ValueError(f"not one memory limit: {items}")
    return items[0]


@pytest.mark.parametrize("text", MEMORY_LIMITS)
def test_memory_limit_means_the_same_everywhere(text: str) -> None:
    cli = _verdict(parse_cli_memory_limit, text, P)  # megatron-pp simulate/draw/verify --memory-limit
    planner = _verdict(lambda t: resolve_limit(_one(argtypes.memory_limit_list(t)), P), text)  # plan --schedule-...
    megatron = _megatron("--pipeline-memory-limit", text)
    assert cli == planner == megatron, (text, cli, planner, megatron)


def test_memory_limit_p_is_one_p() -> None:
    assert parse_cli_memory_limit("p", P) == parse_cli_memory_limit("1p", P) == P
    assert _megatron("--pipeline-memory-limit", "p") == P


@pytest.mark.parametrize("text", COSTS)
def test_costs_mean_the_same_everywhere(text: str) -> None:
    cli = _verdict(lambda t: Costs.parse(t), text)  # megatron-pp --costs
    megatron = _megatron("--pipeline-costs", text)
    if cli == "refused" or megatron == "refused":
        assert cli == megatron, (text, cli, megatron)
    else:
        assert isinstance(cli, Costs)
        assert (cli.t_f, cli.t_b, cli.t_w, cli.t_comm) == megatron, (text, cli, megatron)


@pytest.mark.parametrize("text", LAYER_COSTS)
def test_layer_costs_mean_the_same_for_plan_and_training(text: str) -> None:
    """``plan --layer-costs`` and ``--pipeline-costs KIND=F,B,W;...`` read the same entries or both refuse."""
    plan = _verdict(argtypes.layer_costs, text)
    megatron = _megatron("--pipeline-costs", text)
    if plan == "refused" or megatron == "refused":
        assert plan == megatron, (text, plan, megatron)
    else:
        assert (dict(megatron.entries), megatron.micro_batch, megatron.tp) == plan, (text, plan, megatron)


def test_costs_rule() -> None:
    """F and B > 0 (the planner divides by them), W and COMM may be 0, everything finite and bounded."""
    assert Costs.parse("1,2,0,0") == Costs(1.0, 2.0, 0.0, None, 0.0)
    for bad in ("0,1,1", "1,0,1", "1,1,1e13"):
        with pytest.raises(ValueError, match=r"with F and B > 0"):
            Costs.parse(bad)


@pytest.mark.parametrize("text", UNIT_SIZES)
def test_unit_size_means_the_same_everywhere(text: str) -> None:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_source_args(parser)
    try:
        cli: object = parser.parse_args(["1f1b", f"--pipeline-unit-size={text}"]).unit_size
    except argparse.ArgumentError:
        cli = "refused"
    assert cli == _megatron("--pipeline-unit-size", text), text


@pytest.mark.parametrize("text", ["4", "0.5", "1e12", "0", "-1", "nan", "inf", "1e13", "x", ""])
def test_memory_budget_means_the_same_for_plan_and_auto(text: str) -> None:
    planner = argparse.ArgumentParser(exit_on_error=False)
    add_plan_arguments(planner)
    try:
        plan: object = planner.parse_args([f"--memory-budget={text}"]).memory_budget
    except argparse.ArgumentError:
        plan = "refused"
    parser = add_arguments(argparse.ArgumentParser(exit_on_error=False))
    try:
        auto: object = parser.parse_args([f"--pipeline-memory-budget={text}"]).pipeline_memory_budget
    except argparse.ArgumentError:
        auto = "refused"
    assert plan == auto, text


def test_every_pipeline_flag_is_declared_on_the_config() -> None:
    """Every option add_arguments registers comes from a PipelineConfig field, and each field's flag is registered."""
    parser = add_arguments(argparse.ArgumentParser())
    registered = {o for a in parser._actions for o in a.option_strings if o not in ("-h", "--help")}
    assert registered == {spec.name for _, spec in flags.flag_fields()}
    names = {f for f, _ in flags.flag_fields()}
    assert names <= set(PipelineConfig.__dataclass_fields__)


def test_agreement_fingerprint_covers_what_the_ranks_must_share() -> None:
    keys = [k for k, _ in flags.agreement_fields(PipelineConfig(schedule="1f1b"))]
    expected = ["schedule", "file", "block", "memory_limit", "costs", "v", "layers", "p", "mb_group", "unit_size"]
    expected += ["fsdp", "post_validation", "profile_iters", "check_messages"]
    assert sorted(keys) == sorted(expected)
    fields = dict(flags.agreement_fields(PipelineConfig(schedule="1f1b", fsdp=True, fsdp_max_unsharded=2)))
    assert fields["fsdp"] == "True/2" and fields["schedule"] == "1f1b" and fields["file"] == "-"


def test_docs_flags_md_is_current() -> None:
    assert flags.DOC.read_text() == flags.markdown(), (
        "docs/flags.md is stale: run python -m megatron_pp_ext.integration.flags --write"
    )
