"""ZeroPP's bad input: one error line naming the flag and the valid range, before any rank process
starts; what is *not* an error (U not dividing m, FSDP off) is accepted and runs as documented."""

from __future__ import annotations

import pytest

from megatron_pp_ext.cli import main
from megatron_pp_ext.schedules import generate
from megatron_pp_ext.schedules.collectives import CollectiveKind, derive_collectives, policy_for


def error_of(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code  # type: ignore[assignment]
    _, err = capsys.readouterr()
    assert code == 2, err
    assert "starting" not in err and "Traceback" not in err, err  # refused before any rank process
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


VERIFY = ("verify", "zeropp", "-p", "2", "-m", "4", "-v", "2")


def test_unit_size_out_of_range(capsys: pytest.CaptureFixture[str]) -> None:
    line = error_of(capsys, *VERIFY, "--pipeline-unit-size", "5")
    assert "--pipeline-unit-size" in line and "1..m = 1..4" in line


def test_unit_larger_than_the_memory_limit(capsys: pytest.CaptureFixture[str]) -> None:
    line = error_of(capsys, *VERIFY, "--pipeline-unit-size", "4", "--memory-limit", "3")
    assert "--pipeline-unit-size <= 3" in line and "--memory-limit" in line and "memory_limit >= unit_size" in line


def test_auto_unit_size_below_the_declared_memory_limit(capsys: pytest.CaptureFixture[str]) -> None:
    """'auto' is built through the registry: its declaration refuses a limit under one unit's activations
    before any candidate is simulated, with the same line as a numbered unit size."""
    argv = ["simulate", "zeropp", "-p", "2", "-m", "4", "--memory-limit", "0.5"]
    line = error_of(capsys, *argv, "--pipeline-unit-size", "auto")
    assert "memory_limit >= 1 M_a" in line and "None" not in line
    assert line == error_of(capsys, *argv, "--pipeline-unit-size", "2")


def test_fsdp_setting_without_fsdp(capsys: pytest.CaptureFixture[str]) -> None:
    line = error_of(capsys, *VERIFY, "--dp", "2", "--fsdp-max-unsharded", "2")
    assert "--fsdp-max-unsharded" in line and "--fsdp" in line


def test_unit_not_dividing_m_is_a_shorter_last_unit() -> None:
    """Not an error: units [0, 2), [2, 4), [4, 5); FSDP reduces each chunk once per unit, 3 times."""
    schedule = generate("zeropp", 2, 5, v=2, unit_size=2)
    plan = derive_collectives(schedule, policy_for(schedule, fsdp=True))
    assert [plan.count(CollectiveKind.REDUCE_GRADS, r) for r in range(2)] == [6, 6]


def test_fsdp_off_reduces_once_per_chunk() -> None:
    """zeropp without FSDP: plain data parallelism (all-reduce per chunk after its last gradient op, once per
    iteration; per-unit reductions would only move more data) and no gathers."""
    schedule = generate("zeropp", 2, 4, v=2, unit_size=1)
    plan = derive_collectives(schedule, policy_for(schedule))
    assert [plan.count(CollectiveKind.REDUCE_GRADS, r) for r in range(2)] == [2, 2]
    assert plan.count(CollectiveKind.UNSHARD) == 0
