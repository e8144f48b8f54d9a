"""interleaved-zb (and zb-auto with v chunks) on real gloo ranks: loss and every gradient equal the
single-process reference, over iterations with an optimizer step."""

from __future__ import annotations

import pytest

from megatron_pp_ext.schedules import generate
from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec
from megatron_pp_ext.verification.verify import verify_schedule


@pytest.mark.parametrize(
    ("name", "p", "m", "p2p_tags"),
    [
        ("interleaved-zb", 2, 4, False),  # p=2: both neighbours are one peer; only message order keeps them apart
        ("interleaved-zb", 4, 8, True),
        ("zb-auto", 2, 5, True),
    ],
)
def test_loop_zero_bubble_with_two_chunks_verifies(pool, name, p, m, p2p_tags):
    schedule = generate(name, p, m, v=2)
    assert schedule.chunks_per_rank == 2 and any(op.kind.name == "W" for row in schedule.ops for op in row)
    model = TinyGPTSpec(num_layers=2 * p)
    report = verify_schedule(schedule, pool, model=model, iterations=2, p2p_tags=p2p_tags)
    assert report.problems == []
    assert report.ok, report
