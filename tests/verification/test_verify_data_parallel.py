"""Data parallelism inside the schedule, on real gloo ranks: P x DP ranks against the unpartitioned reference.

The derived collectives (``schedules/collectives.py``) are launched by the executor: megatron DDP's
gradient reduction per chunk (with ``overlap_grad_reduce``), the distributed optimizer's
reduce-scatter and overlapped parameter gathers, and per-chunk FSDP (``runtime/fsdp.py``) gathers
and frees. Besides the loss and every gradient, the tests check that the deferred work happened
where it was placed: every chunk launched its reduction once, a chunk that finishes early started
its reduction while the rank still had backward work, and FSDP gathered exactly as often as the
lowering derived.
"""

from __future__ import annotations

import pytest

from megatron_pp_ext.schedules import generate
from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec
from megatron_pp_ext.verification.verify import verify_schedule
from megatron_pp_ext.verification.verify_report import VerifyReport

# (schedule, p, m, v, distributed optimizer)
CASES = [
    ("1f1b", 2, 4, None, False),
    ("interleaved-1f1b", 2, 4, 2, False),
    ("interleaved-1f1b", 2, 4, 2, True),
    ("zb-h1", 2, 4, None, True),  # split B/W under DDP overlap: B hands megatron's dummy wgrad
    ("v-half", 2, 4, None, False),
    ("bfs", 2, 4, 2, False),
    ("bfs", 2, 4, 2, True),
    ("bfs-zb", 2, 4, 2, True),
    ("bitpipe", 2, 4, None, False),  # replica sync, then the data-parallel reduction, per chunk
    ("bitpipe", 2, 4, None, True),
]


def _schedule(name: str, p: int, m: int, v: int | None):  # type: ignore[no-untyped-def]
    return generate(name, p, m, **({"v": v} if v else {}))


_REPORTS: dict[tuple[object, ...], VerifyReport] = {}


def _verified(pool, name: str, p: int, m: int, v: int | None, dist_opt: bool) -> VerifyReport:  # type: ignore[no-untyped-def]
    """verify_schedule on DP = 2 ranks, once per shape in this module: tests that check other properties of the
    same run share it (a run is deterministic: the same spec on the same pool repeats the same operations)."""
    key = (name, p, m, v, dist_opt)
    if key not in _REPORTS:
        _REPORTS[key] = verify_schedule(_schedule(name, p, m, v), pool, dp=2, distributed_optimizer=dist_opt)
    return _REPORTS[key]


@pytest.mark.parametrize(("name", "p", "m", "v", "dist_opt"), CASES)
def test_data_parallel_matches_reference(pool, name, p, m, v, dist_opt):
    schedule = _schedule(name, p, m, v)
    report = _verified(pool, name, p, m, v, dist_opt)
    assert report.ok, report.problems or (report.max_rel_grad_diff, report.max_abs_loss_diff)
    chunks = schedule.chunks_per_rank
    for rank, launches in enumerate(report.collectives):
        reductions = [x for x in launches if x.startswith("reduce-grads")]
        assert len(reductions) == chunks, (rank, launches)  # each chunk reduced once
        if schedule.placement.num_replicas == 2:  # each chunk's replica sum precedes its DP reduction
            syncs = [x.split()[0].replace("replica-sync", "reduce-grads") for x in launches if "replica-sync" in x]
            assert syncs == [x.split()[0] for x in reductions], launches
        if dist_opt:
            assert sum(x.startswith("param-sync") for x in launches) == chunks, (rank, launches)


def test_early_chunk_reduction_overlaps_the_remaining_backward(pool):
    """Interleaved: a rank's later chunk finishes its backwards first; its reduction starts while the
    rank still has backward work of the other chunk to do (breadth-first's point, here on v=2)."""
    report = _verified(pool, "interleaved-1f1b", 2, 4, 2, False)  # test_data_parallel_matches_reference's run
    assert report.ok
    for rank, launches in enumerate(report.collectives):
        first, last = [x for x in launches if x.startswith("reduce-grads")]
        assert first == f"reduce-grads[s{rank + 2}] (overlaps backward)", launches
        assert last == f"reduce-grads[s{rank}]", launches


@pytest.mark.parametrize(("name", "gathers"), [("interleaved-1f1b", [11, 5]), ("bfs", [3, 3])])
def test_fsdp_gathers_as_derived_and_matches_reference(pool, name, gathers):
    """Breadth-first gathers a chunk once per sweep (2v-1 per rank: the last chunk stays gathered
    across the turn); interleaved 1F1B nearly once per micro-batch."""
    model = TinyGPTSpec(num_layers=4, tied_embeddings=False)
    report = verify_schedule(_schedule(name, 2, 4, 2), pool, model=model, dp=2, fsdp=True)
    assert report.ok, report.problems
    assert [info["derived_unshards"] for info in report.fsdp] == gathers
    for info in report.fsdp:
        assert info["all_gathers_per_iteration"] == [info["derived_unshards"]] * 3
        # about 1/N of the weights as shards, one chunk gathered at a time
        assert info["peak_bytes"]["full_params"] == max(info["full_param_bytes_per_chunk"])


def test_fsdp_refuses_tied_embeddings_and_distributed_optimizer(pool):
    schedule = _schedule("1f1b", 2, 2, None)
    with pytest.raises(ValueError, match="untied"):
        verify_schedule(schedule, pool, dp=2, fsdp=True)
    with pytest.raises(ValueError, match="distributed-optimizer"):
        verify_schedule(
            schedule, pool, dp=2, fsdp=True, distributed_optimizer=True, model=TinyGPTSpec(tied_embeddings=False)
        )
