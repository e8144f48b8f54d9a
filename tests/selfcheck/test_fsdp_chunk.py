"""Per-chunk FSDP (runtime/fsdp.py) on DP=2 gloo ranks against a single-process reference."""

from __future__ import annotations

import pytest

from megatron_pp_ext.selfcheck.fsdp_check import FsdpCase, fsdp_check
from megatron_pp_ext.verification.rank_pool import check_errors
from megatron_pp_ext.verification.rank_run import TrainingRankPool
from tests.tiers import launches_ranks
from tests.warm_pool import WARM_MODULE

pytestmark = pytest.mark.gloo


@pytest.fixture(scope="module")
@launches_ranks
def pool():
    """Two warm ranks for this module only (the session pool of conftest has four)."""
    with TrainingRankPool(2, warm_module=WARM_MODULE) as ranks:
        yield ranks


def _run(pool: TrainingRankPool, case: FsdpCase) -> list[dict]:
    results = pool.run_fn(fsdp_check, case, case.dp, 240)
    check_errors(results)
    for r in results:
        assert r["problems"] == [], r["problems"]
    return results


def _assert_exact_as_fp32(results: list[dict]) -> None:
    """The verification criterion (gradients, their squared norm and trained parameters against the
    float64 run, allowance GROWTH x the fp32 run's own distance), on every rank."""
    for r in results:
        assert r["verdict_cells"] > 0 and r["verdict_problems"] == [], r
        assert r["verdict_ok"], r["verdict"]


def test_breadth_first_sweeps_reduce_to_the_reference_average(pool):
    results = _run(pool, FsdpCase(microbatches=3, iterations=2))
    _assert_exact_as_fp32(results)  # local_grad_sq_norm summed over DP judged too ("grad norm^2")
    for r in results:
        assert r["storage_freed"]
        assert "sharded (call unshard)" in r["sharded_forward_error"]


def test_split_backward_w_after_reshard_and_regather(pool):
    results = _run(pool, FsdpCase(microbatches=3, split_backward=True))
    _assert_exact_as_fp32(results)
    for r in results:
        assert r["unshard_calls"] == [[3, 3]]  # F, B and W sweeps of each chunk


def test_split_backward_w_while_sharded(pool):
    """megatron linears' W needs only the saved input and output gradient, not the weights."""
    results = _run(pool, FsdpCase(microbatches=3, split_backward=True, w_while_sharded=True))
    _assert_exact_as_fp32(results)
    for r in results:
        assert r["unshard_calls"] == [[2, 2]]


def test_three_adam_steps_match_the_reference(pool):
    results = _run(pool, FsdpCase(microbatches=2, iterations=3, adam=True))
    _assert_exact_as_fp32(results)  # trained parameters included
    for r in results:
        assert len(r["param_rel"]) == 3
        # the sharded step alone, given the same gradients: Adam's own rounding (fsdp_check)
        for got, bound in zip(r["param_rel"], r["param_step_bound"], strict=True):
            assert got <= bound, (r["param_rel"], r["param_step_bound"])


def test_counters_and_peak_memory(pool):
    results = _run(pool, FsdpCase(microbatches=2, iterations=2))
    for r in results:
        for calls, counters in zip(r["unshard_calls"], r["counters"], strict=True):
            assert [g for g, _ in counters] == calls == [2, 2]  # one gather per sweep, not per micro-batch
            assert [rs for _, rs in counters] == [1, 1]  # one reduce-scatter per chunk and iteration
        assert r["total_all_gathers"] == [4, 4]
        peak = r["memory_peak"]
        shard_bytes = sum(2 * 4 * s for s in r["shard_numel"])  # fp32 param + grad shard per chunk
        assert peak["shard"] == shard_bytes
        assert shard_bytes <= 2 * sum(r["weight_bytes"]) / 2 + 64  # 1/N of weights (param + grad), padding
        assert peak["full_params"] == max(r["full_param_bytes"])  # one chunk gathered at a time
        # chunk 1's gradient is reduce-scattered while chunk 0's backward accumulates its own
        assert peak["full_grads"] == sum(r["full_grad_bytes"])
        assert r["memory_peak_total"] <= shard_bytes + max(r["full_param_bytes"]) + sum(r["full_grad_bytes"])


def test_async_prefetch_of_the_next_chunk(pool):
    results = _run(pool, FsdpCase(microbatches=2, prefetch=True))
    _assert_exact_as_fp32(results)
    for r in results:
        assert r["counters"] == [[(2, 1), (2, 1)]]
        assert r["memory_peak"]["full_params"] == sum(r["full_param_bytes"])  # both chunks gathered at once


def test_extra_grad_reduction_sums_over_the_other_group_first(pool):
    name = "output_layer.weight"
    results = _run(pool, FsdpCase(microbatches=2, extra_reduce_param=name))
    _assert_exact_as_fp32(results)


def test_tied_embedding_with_both_ends_on_one_rank(pool):
    """V-shape's case: the two copies of the word embedding get the summed gradient and stay equal."""
    results = _run(pool, FsdpCase(microbatches=2, iterations=2, adam=True, tied=True))
    _assert_exact_as_fp32(results)
    for r in results:
        for got, bound in zip(r["param_rel"], r["param_step_bound"], strict=True):
            assert got <= bound, (r["param_rel"], r["param_step_bound"])


def test_backward_of_a_resharded_chunk_fails_clearly(pool):
    results = _run(pool, FsdpCase(microbatches=2, backward_while_sharded=True))
    for r in results:
        assert "backward of chunk 0 while its parameters are sharded" in r["sharded_backward_error"]


def test_a_missing_peer_times_out_naming_rank_and_op(pool):
    results = pool.run_fn(fsdp_check, FsdpCase(skip_unshard_on_rank=1, timeout_s=2.0), 2, 120)
    check_errors(results)
    message = results[0]["timeout_error"]
    assert "rank 0" in message and "all-gather (unshard)" in message and "chunk 0" in message


def live_chunks_and_gloo_threads(_payload: object, _rank: int, _init_method: str) -> dict[str, int]:
    """In a pool worker, after its runs: ShardedChunk objects still alive and gloo threads still running."""
    import gc

    from megatron_pp_ext.runtime.fsdp import ShardedChunk
    from tests.verification.thread_helpers import gloo_threads

    gc.collect()
    chunks = sum(isinstance(o, ShardedChunk) for o in gc.get_objects())
    return {"chunks": chunks, "gloo_threads": gloo_threads()}


def test_finished_runs_release_their_chunks_and_process_groups(pool):
    """A chunk's gradient hooks live on its parameters, where torch's cycle collector does not look: if they
    held the chunk strongly, every finished run would keep its chunks, modules and process groups (and their
    gloo threads) alive in the worker, and a worker reused for many runs would pile up hundreds of threads."""
    for _ in range(2):
        _run(pool, FsdpCase(microbatches=2))
    after = pool.run_fn(live_chunks_and_gloo_threads, None, 2, 60)
    for r in after:
        assert r["chunks"] == 0, after
    _run(pool, FsdpCase(microbatches=2))
    again = pool.run_fn(live_chunks_and_gloo_threads, None, 2, 60)
    for before_run, after_run in zip(after, again, strict=True):  # a finished run leaves no gloo threads behind
        assert after_run["gloo_threads"] <= before_run["gloo_threads"], (after, again)
