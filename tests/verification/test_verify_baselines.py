"""Real multi-process gloo runs of the baseline schedules against the unpartitioned reference."""

from __future__ import annotations

import pytest

from megatron_pp_ext.schedules import Schedule, generate
from megatron_pp_ext.verification.rank_pool import VerifyRunError, check_errors
from megatron_pp_ext.verification.run_spec import NATIVE, OURS, RunHooks, RunSpec
from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec
from megatron_pp_ext.verification.verify import verify_schedule

CASES = [
    ("1f1b", 2, 1, None),  # m < p
    ("1f1b", 2, 2, None),  # m = p
    ("1f1b", 2, 5, None),  # m not a multiple of p
    ("1f1b", 4, 3, None),
    ("1f1b", 4, 6, None),
    ("gpipe", 2, 3, None),
    ("gpipe", 4, 2, None),
    ("gpipe", 4, 5, None),
    ("interleaved-1f1b", 2, 2, 2),
    ("interleaved-1f1b", 2, 4, 2),
    ("interleaved-1f1b", 4, 4, 2),
]


@pytest.mark.parametrize(("name", "p", "m", "v"), CASES)
def test_verify_matches_reference(pool, name, p, m, v):
    schedule = generate(name, p, m, v=v)
    report = verify_schedule(schedule, pool, iterations=3)
    assert report.problems == []
    assert report.ok, report
    assert report.iterations == 3
    assert report.bitwise_megatron_1f1b is (True if name == "1f1b" else None)  # every loss and gradient, bit for bit
    assert len(report.peak_activation_bytes) == p and min(report.peak_activation_bytes) > 0


def _losses_and_grads(results):
    check_errors(results)
    losses = [r["losses"] for r in results]
    grads = {k: g for r in results for step in r["grads"] for k, g in step.items()}
    return losses, grads


# p = 2 (m = 5): test_verify_matches_reference[1f1b-2-5-None], through verify's bitwise check
@pytest.mark.parametrize("p", [4])
def test_our_1f1b_is_bitwise_megatron_1f1b(pool, p):
    """Same op order, same math: our executor reproduces megatron's own 1F1B bit for bit (without the tracer;
    verify_schedule compares every 1f1b case of test_verify_matches_reference with megatron's 1F1B too)."""
    m = 2 * p + 1
    csv = generate("1f1b", p, m).to_csv()
    model = TinyGPTSpec(num_layers=p)
    native = pool.run(RunSpec(pp=p, num_microbatches=m, schedule_csv=csv, mode=NATIVE, model=model))
    ours = pool.run(RunSpec(pp=p, num_microbatches=m, schedule_csv=csv, mode=OURS, model=model))
    native_losses, native_grads = _losses_and_grads(native)
    our_losses, our_grads = _losses_and_grads(ours)
    assert our_losses == native_losses
    assert native_grads.keys() == our_grads.keys()
    for key, g in native_grads.items():
        assert our_grads[key].equal(g), key


@pytest.mark.parametrize(("name", "p", "m", "v"), [("1f1b", 4, 5, None), ("interleaved-1f1b", 2, 4, 2)])
def test_forward_only_evaluation(pool, name, p, m, v):
    schedule = generate(name, p, m, v=v)
    model = TinyGPTSpec(num_layers=schedule.placement.stages_per_replica)
    ref = pool.run(RunSpec(pp=1, num_microbatches=m, mode=NATIVE, model=model, forward_only=True, iterations=2))
    run = pool.run(
        RunSpec(pp=p, num_microbatches=m, schedule_csv=schedule.to_csv(), model=model, forward_only=True, iterations=2)
    )
    ref_losses, _ = _losses_and_grads(ref)
    run_losses, grads = _losses_and_grads(run)
    assert grads == {}
    holder = next(x for x in run_losses if x[0])
    assert len(holder[0]) == m
    for got, want in zip(holder, ref_losses[0], strict=True):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-7)


def test_mismatched_schedule_fails_fast_naming_rank_and_op(pool, monkeypatch):
    """Rank 1 runs a schedule for 3 micro-batches, rank 0 for 2: rank 1 waits for mb 2 forever.

    (The start-of-run agreement, tests/runtime/test_agreement.py, catches this first; it is switched
    off here to test the receive timeout behind it.)"""
    # Rank 0 is left waiting for rank 1 in a collective that only the group's timeout ends: the pool kills it after
    # its grace (the pool respawns it, warm, in a moment); a second of grace instead of 15 (the verdict is rank 1's).
    monkeypatch.setattr(pool, "grace_s", 1.0)
    good = generate("1f1b", 2, 2)
    longer = generate("1f1b", 2, 3)
    spec = RunSpec(
        pp=2,
        num_microbatches=2,
        schedule_csv=good.to_csv(),
        model=TinyGPTSpec(num_layers=2),
        iterations=1,
        timeout_s=5.0,
        hooks=RunHooks(
            schedule_csv_overrides=(
                (1, Schedule.from_csv(longer.to_csv()).to_csv().replace("microbatches=3", "microbatches=2")),
            ),
            check_agreement=False,
        ),
    )
    results = pool.run(spec, wall_timeout_s=120)  # a hang guard; the verdict is the message (a 5 s receive timeout)
    with pytest.raises(VerifyRunError) as info:
        check_errors(results)
    message = str(info.value)
    assert "pipeline rank 1" in message
    assert "did not complete within 5s" in message
    assert "F1.2" in message or "mb2" in message


@pytest.mark.parametrize(
    ("name", "p", "m", "v"), [("1f1b", 2, 4, None), ("interleaved-1f1b", 4, 4, 2), ("interleaved-1f1b", 2, 4, 2)]
)
def test_ab_mode_runs_megatron_and_ours_with_equal_losses_and_saved_bytes(pool, name, p, m, v):
    """Mode AB (bench_peer_runs.py): megatron's 1F1B / interleaved 1F1B and ours, alternating, same losses;
    the saved-bytes meter sees the same peak for both (same op order, same math)."""
    from megatron_pp_ext.verification.run_spec import AB

    csv = generate(name, p, m, v=v).to_csv()
    results = pool.run(
        RunSpec(
            pp=p,
            num_microbatches=m,
            schedule_csv=csv,
            mode=AB,
            model=TinyGPTSpec(num_layers=8),
            iterations=2,
            megatron_overlap_p2p=p == 2 and v is not None,  # megatron's batched p2p is wrong at PP=2 interleaved
        )
    )
    check_errors(results)
    for r in results:
        assert r["losses"][NATIVE] == r["losses"][OURS] and len(r["losses"][OURS]) == 2
        assert r["peak_saved_bytes"][NATIVE] == r["peak_saved_bytes"][OURS] > 0


def test_trace_keeps_the_last_iterations_ops_on_one_clock(pool):
    """bench_peer_runs --gantt draws the measured trace from `last_iteration_ops`: every op of the rank, in
    program order, with start <= end, on a clock shared by the ranks (rank 1's first op after rank 0's)."""
    schedule = generate("1f1b", 2, 3)
    spec = RunSpec(
        pp=2, num_microbatches=3, schedule_csv=schedule.to_csv(), trace=True, model=TinyGPTSpec(num_layers=2)
    )
    results = pool.run(spec)
    check_errors(results)
    ops = {r["pp_rank"]: r["trace"]["last_iteration_ops"] for r in results}
    for rank, row in ops.items():
        assert [op for op, _, _ in row] == [str(op) for op in schedule.ops[rank]]
        assert all(a <= b for _, a, b in row) and all(row[i][2] <= row[i + 1][1] for i in range(len(row) - 1))
    assert ops[1][0][1] >= ops[0][0][2]  # F1.0 starts after F0.0 ended (it needs its activation)


def _gloo_threads(_payload: object, _rank: int, _init_method: str) -> int:
    from .thread_helpers import gloo_threads

    return gloo_threads()


@pytest.mark.parametrize("experts", [None, 4], ids=["dense", "moe"])
def test_finished_megatron_ddp_runs_release_their_process_groups(pool, experts):
    """A run's megatron modules and DDP form reference cycles that hold its process groups; a reused pool
    worker that never collected them kept ~19 more gloo threads per run (spinning once the peers were gone:
    hundreds by the end of a suite). Two further DDP runs leave the worker's gloo threads where they were;
    with MoE layers too, whose token dispatcher keeps the last micro-batch's probabilities with their
    autograd graph (a cycle through C++ autograd nodes that only the teardown's detach breaks)."""
    model = TinyGPTSpec(num_layers=2, num_experts=experts)
    spec = RunSpec(pp=1, mode=NATIVE, num_microbatches=2, dp=2, model=model, iterations=1)
    check_errors(pool.run(spec))
    before = pool.run_fn(_gloo_threads, None, 2, 60)
    for _ in range(2):
        check_errors(pool.run(spec))
    after = pool.run_fn(_gloo_threads, None, 2, 60)
    assert after == before, (before, after)
