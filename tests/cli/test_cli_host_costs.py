"""``megatron-pp simulate --host-costs``: the runtime's host time per op and per exchange, charged as busy time."""

from __future__ import annotations

import json

import pytest

from megatron_pp_ext.cli.main import main
from megatron_pp_ext.schedules.values import parse_host_costs


def _makespan(capsys: pytest.CaptureFixture[str], *argv: str) -> float:
    assert main(["simulate", *argv, "--json"]) == 0
    return float(json.loads(capsys.readouterr().out)["makespan"])


@pytest.mark.parametrize(
    "text,value",
    [("0.2", (0.2, 0.0)), ("0.2, 0.3", (0.2, 0.3)), ("0,0", (0.0, 0.0)), ("-1", None), ("1,2,3", None), ("x", None)],
)
def test_host_costs_parser(text: str, value: tuple[float, float] | None) -> None:
    if value is None:
        with pytest.raises(ValueError, match="PER_OP"):
            parse_host_costs(text)
    else:
        assert parse_host_costs(text) == value


def test_gpipe_on_one_rank_pays_the_host_cost_once_per_op(capsys: pytest.CaptureFixture[str]) -> None:
    """p = 1: no exchange, so 2m ops each pay the per-op cost and nothing else."""
    plain = _makespan(capsys, "gpipe", "-p", "1", "-m", "4", "--costs", "1,1,1")
    charged = _makespan(capsys, "gpipe", "-p", "1", "-m", "4", "--costs", "1,1,1", "--host-costs", "0.25,5")
    assert charged == pytest.approx(plain + 8 * 0.25)


def test_an_exchange_costs_its_sender(capsys: pytest.CaptureFixture[str]) -> None:
    """gpipe on 2 ranks: the critical path crosses the ranks through the senders' exchanges."""
    plain = _makespan(capsys, "gpipe", "-p", "2", "-m", "4", "--costs", "1,1,1")
    op_only = _makespan(capsys, "gpipe", "-p", "2", "-m", "4", "--costs", "1,1,1", "--host-costs", "0.25")
    both = _makespan(capsys, "gpipe", "-p", "2", "-m", "4", "--costs", "1,1,1", "--host-costs", "0.25,0.5")
    assert plain < op_only < both


def test_a_bad_value_is_one_line_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "1f1b", "-p", "2", "-m", "4", "--host-costs", "nan"])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--host-costs" in err and "PER_OP" in err
