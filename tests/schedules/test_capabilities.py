"""Declared capabilities: every schedule declares them, one check applies them, old registrations work."""

from __future__ import annotations

import pytest

from megatron_pp_ext.schedules import registry
from megatron_pp_ext.schedules.capabilities import (
    Capabilities,
    DataParallel,
    ScheduleParameterError,
    check_request,
)
from megatron_pp_ext.schedules.generators.baselines import one_f_one_b
from megatron_pp_ext.schedules.registry import ScheduleInfo


@pytest.mark.parametrize("name", registry.names())
def test_every_schedule_declares_what_it_takes(name: str) -> None:
    info = registry.get(name)
    caps = info.capabilities
    if caps is None:  # registered with the fields of before: it works, but declare what it takes
        pytest.xfail(f"{name} declares no capabilities (ScheduleInfo(..., capabilities=Capabilities(...)))")
    assert caps.chunks.accepts(caps.chunks.default)
    assert (caps.memory_limit is None) or caps.fixed_memory is None
    assert info.requirements.startswith(f"p >= {caps.min_p}, m >= {caps.min_m}")
    checked = info.check(caps.min_p, 1)
    assert set(checked) <= {"v"}


def test_takes_follows_the_declarations() -> None:
    assert registry.get("zb-auto").takes("costs") and registry.get("v-zb").takes("memory_limit")
    assert not registry.get("1f1b").takes("costs") and not registry.get("zb-h2").takes("memory_limit")
    assert registry.get("interleaved-1f1b").takes("microbatch_group_size") and registry.get("interleaved-1f1b").takes(
        "v"
    )
    assert registry.get("v-block").takes("block_file") and not registry.get("v-min").takes("block_file")


def test_data_parallel_requirements() -> None:
    caps = Capabilities(data_parallel=DataParallel(min_size=2, fsdp="required"))
    with pytest.raises(ScheduleParameterError, match="data-parallel size >= 2, got 1"):
        check_request("x", caps, 2, 4, {}, data_parallel=1)
    with pytest.raises(ScheduleParameterError, match="needs FSDP"):
        check_request("x", caps, 2, 4, {}, data_parallel=2)
    assert check_request("x", caps, 2, 4, {}, data_parallel=2, fsdp=True) == {}
    with pytest.raises(ScheduleParameterError, match="does not shard"):
        check_request("x", Capabilities(), 2, 4, {}, fsdp=True)
    assert "data-parallel >= 2, FSDP required" in caps.describe()


def test_a_registration_without_a_declaration_runs_one_chunk() -> None:
    """A ScheduleInfo made without capabilities declares the default: one chunk per rank, no keyword."""
    info = ScheduleInfo("plain-test", one_f_one_b, "loop", False, "", "plain")
    assert info.capabilities == Capabilities() and not info.takes("memory_limit") and not info.takes("costs")
    assert info.build(2, 3, v=None).num_microbatches == 3
    with pytest.raises(ScheduleParameterError, match="one chunk per rank"):
        info.build(2, 3, v=2)


def test_requirements_do_not_repeat_the_declaration() -> None:
    """``megatron-pp list`` and the error lines print the declaration, then only the generator's further rules
    (bfs once printed "p >= 1, m >= 1, v >= 1 (default 2)" twice)."""
    from megatron_pp_ext.schedules import registry

    for name in registry.names():
        info = registry.get(name)
        declared, _, further = info.requirements.partition("; ")
        items = [x.strip() for x in declared.split(", ")]
        assert not any(x in items for x in further.split(", ")), (name, info.requirements)
    assert registry.get("bfs").requirements.count("v >= 1 (default 2)") == 1
