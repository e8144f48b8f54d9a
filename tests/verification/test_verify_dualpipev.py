"""DualPipeV on real gloo ranks: serial pairs (no hook) and a recording overlap hook match the reference."""

from __future__ import annotations

import pytest

from megatron_pp_ext.schedules import generate
from megatron_pp_ext.verification import criterion
from megatron_pp_ext.verification.compare import compare
from megatron_pp_ext.verification.rank_pool import check_errors
from megatron_pp_ext.verification.reference import reference_runs
from megatron_pp_ext.verification.run_spec import OURS, RunSpec
from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec
from megatron_pp_ext.verification.verify import verify_schedule

from .overlap_helpers import run_with_recording_hook


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8)])
def test_dualpipev_matches_reference(pool, p: int, m: int) -> None:
    report = verify_schedule(generate("dualpipev", p, m), pool, iterations=2)
    assert report.problems == []
    assert report.ok, report


@pytest.mark.parametrize(("p", "m"), [(2, 5), (4, 8)])
def test_overlap_hook_runs_every_pair_and_matches_reference(pool, p: int, m: int) -> None:
    """Each chunk gets a hook that records its calls and runs the backward first: the executor hands it
    exactly the schedule's pairs (forward's chunk owns the hook), and losses and gradients still match."""
    schedule = generate("dualpipev", p, m)
    model = TinyGPTSpec(num_layers=2 * p)
    common = {"model": model, "iterations": 2, "adam_eps": criterion.ADAM_EPS, "lr": criterion.LR}
    spec = RunSpec(pp=p, num_microbatches=m, mode=OURS, schedule_csv=schedule.to_csv(), split_backward=True, **common)
    exact, ref = reference_runs(pool, spec)
    run = pool.run_fn(run_with_recording_hook, spec, p, 300)
    check_errors(run)
    for rank, result in enumerate(run):
        row = schedule.ops[rank]
        expected = [(str(row[i]), str(row[i + 1])) for i in schedule.overlap_pairs[rank]] * common["iterations"]
        calls = result["overlap_calls"]
        assert [(f, b) for f, b, _, _ in calls] == expected
        for forward, _, hook_chunk, owner in calls:
            assert hook_chunk == owner == schedule.placement.chunk_of(int(forward[1:].split(".")[0]))
    report = compare(schedule.name, p, m, 2, ref, run, exact=exact)
    assert report.problems == []
    assert report.ok, report
