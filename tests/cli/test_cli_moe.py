"""``megatron-pp simulate``'s MoE all-to-all flags, in-process: the values' one parser, the model's figures,
refusals naming the flag."""

from __future__ import annotations

import json
import re

import pytest

from megatron_pp_ext.cli.main import main
from megatron_pp_ext.schedules.values import parse_a2a_time, parse_moe_layers


def _makespan(capsys: pytest.CaptureFixture[str], *argv: str) -> float:
    assert main(["simulate", *argv, "--json"]) == 0
    return float(json.loads(capsys.readouterr().out)["makespan"])


@pytest.mark.parametrize(
    "text,value", [("0", 0.0), (" 2.5 ", 2.5), ("1e12", 1e12), ("-1", None), ("nan", None), ("x", None), ("", None)]
)
def test_a2a_time_parser(text: str, value: float | None) -> None:
    if value is None:
        with pytest.raises(ValueError, match="all-to-all"):
            parse_a2a_time(text)
    else:
        assert parse_a2a_time(text) == value


@pytest.mark.parametrize(
    "text,value", [("4", 4), ("0", 0), ("3,4, 4", (3, 4, 4)), ("-1", None), ("1.5", None), ("", None), ("1,,2", None)]
)
def test_moe_layers_parser(text: str, value: object) -> None:
    if value is None:
        with pytest.raises(ValueError, match="MoE layers"):
            parse_moe_layers(text)
    else:
        assert parse_moe_layers(text) == value


def test_simulate_moe_flags(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["dualpipev", "-p", "4", "-m", "8", "--costs", "1,1,1"]
    plain = _makespan(capsys, *base)
    assert _makespan(capsys, *base, "--moe-a2a", "0") == plain
    serial = _makespan(capsys, *base, "--moe-a2a", "0.5", "--moe-layers", "2")
    hidden = _makespan(capsys, *base, "--moe-a2a", "0.5", "--moe-layers", "2", "--overlap-moe-expert-parallel-comm")
    assert hidden < serial
    assert main(["simulate", *base, "--moe-a2a", "0.5", "--overlap-moe-expert-parallel-comm"]) == 0
    assert "hidden in" in capsys.readouterr().out
    gpipe = ["simulate", "gpipe", "-p", "2", "-m", "4"]
    assert main([*gpipe, "--moe-a2a", "1", "--overlap-moe-expert-parallel-comm"]) == 0
    assert "hidden in 1 overlapped F&B pairs" in capsys.readouterr().out  # its one turn from F to B


@pytest.mark.parametrize("name", ["1f1b", "zb-h1", "v-zb"])
def test_simulate_overlap_marks_the_executors_pairs(capsys: pytest.CaptureFixture[str], name: str) -> None:
    """Schedules that carry no pairs of their own get the executor's (schedules/pairs.py), timed on two
    streams (whether that is faster depends on the pair's later sends: docs/moe.md)."""
    base = [name, "-p", "4", "-m", "8", "--costs", "1,1,1", "--moe-a2a", "0.5", "--moe-layers", "2"]
    serial = _makespan(capsys, *base)
    assert _makespan(capsys, *base, "--overlap-moe-expert-parallel-comm") != serial
    assert main(["simulate", *base, "--overlap-moe-expert-parallel-comm"]) == 0
    assert re.search(r"hidden in \d+ overlapped F&B pairs", capsys.readouterr().out)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--moe-layers", "2"], "--moe-layers: only with --moe-a2a"),
        (["--overlap-moe-expert-parallel-comm"], "--overlap-moe-expert-parallel-comm: only with --moe-a2a"),
        (["--moe-a2a", "1", "--moe-layers", "1,2"], "--moe-layers lists 2 stages"),
        (["--moe-a2a", "1", "--overlap-moe-expert-parallel-comm", "--overlap", "0.5"], "not with --overlap"),
    ],
)
def test_simulate_moe_refusals(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main(["simulate", "dualpipev", "-p", "2", "-m", "4", *argv]) != 0
    assert message in capsys.readouterr().err
