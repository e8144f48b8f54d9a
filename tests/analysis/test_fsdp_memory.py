"""The FSDP full-buffer model (analysis/fsdp_memory.py): gathered parameters and unreduced gradients per rank
from the lowering; per-unit gradient reductions shorten how long gradient buffers live."""

from __future__ import annotations

import pytest

from megatron_pp_ext.analysis.fsdp_memory import fsdp_buffer_peaks
from megatron_pp_ext.schedules import generate
from megatron_pp_ext.schedules.collectives import derive_collectives, policy_for


def peaks(schedule, **policy):  # type: ignore[no-untyped-def]
    plan = derive_collectives(schedule, policy_for(schedule, fsdp=True, **policy))
    return fsdp_buffer_peaks(plan, [1.0] * schedule.num_stages)


def test_breadth_first_holds_one_chunk_of_each() -> None:
    """bfs with one gathered chunk: a chunk's backward sweep ends (and reduces) before the next one's starts."""
    result = peaks(generate("bfs", 2, 4, v=2))
    assert result.params == (1.0, 1.0) and result.grads == (1.0, 1.0) and result.total == (2.0, 2.0)


@pytest.mark.parametrize(("p", "m", "v"), [(2, 8, 2), (4, 8, 2), (2, 8, 4)])
def test_zeropp_per_unit_reduction_shortens_gradient_buffers_not_their_peak(p: int, m: int, v: int) -> None:
    """Units overlap and W passes are staggered, so at some point every chunk holds unreduced gradients of some
    unit (peak: v chunks either way); between a unit's reduction and the next gradient op the buffer is free,
    so the mean over the ops falls for every U < m (equal at U = m, one reduction)."""
    for unit in (1, 2, m):
        schedule = generate("zeropp", p, m, v=v, unit_size=unit)
        per_unit, once = peaks(schedule), peaks(schedule, grad_reduce_unit=m)
        assert per_unit.grads == once.grads == (float(v),) * p
        assert per_unit.params == (float(min(2, v)),) * p  # zeropp's declared gathered-chunk limit
        if unit < m:
            assert all(a < b for a, b in zip(per_unit.mean_grads, once.mean_grads, strict=True))
        else:
            assert per_unit.mean_grads == once.mean_grads


def test_sizes_per_stage() -> None:
    schedule = generate("zeropp", 2, 4, v=2, unit_size=2)
    plan = derive_collectives(schedule, policy_for(schedule, fsdp=True, fsdp_max_unsharded=1))
    result = fsdp_buffer_peaks(plan, [1.0, 2.0, 4.0, 8.0], grad_bytes=[10.0, 20.0, 40.0, 80.0])
    assert result.params == (4.0, 8.0)  # one gathered chunk at a time: the larger of stages {0, 2} / {1, 3}
    assert result.grads == (50.0, 100.0)
    with pytest.raises(ValueError, match="one number per stage"):
        fsdp_buffer_peaks(plan, [1.0])
