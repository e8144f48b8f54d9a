"""simulate() with a data-parallel stream per rank: ring times, issue order, gathers gating ops, the
drain at the end, nothing changed without dp; breadth-first against interleaved 1F1B."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pp_ext.analysis import simulate
from megatron_pp_ext.schedules import generate
from megatron_pp_ext.schedules.collectives import CollectiveKind, CollectivePolicy, policy_for
from megatron_pp_ext.schedules.costs import Costs

FSDP1 = CollectivePolicy(fsdp_max_unsharded=1)
DIST = CollectivePolicy(param_sync=True)


def test_without_dp_nothing_changes() -> None:
    for name, v in (("bfs", 2), ("interleaved-1f1b", 2), ("zb-h1", None)):
        schedule = generate(name, 4, 8, v=v)
        plain = simulate(schedule, Costs(1, 2, 1, None, 0.1))
        assert plain.data_parallel is None
        assert "data_parallel" not in plain.to_json_dict()
        with pytest.raises(ValueError, match="give dp"):
            simulate(schedule, dp_bandwidth=1.0)


def test_free_collectives_change_no_time() -> None:
    schedule = generate("bfs", 4, 8, v=2)
    plain = simulate(schedule)
    for policy in (CollectivePolicy(), FSDP1, DIST):
        result = simulate(schedule, collectives=policy, dp=8, dp_bandwidth=1.0, param_bytes=0.0)
        assert result.starts == plain.starts and result.makespan == plain.makespan
        assert result.data_parallel is not None and result.data_parallel.exposed == [0.0] * 4


@pytest.mark.parametrize("dp", [2, 4, 8])
def test_ring_times_one_rank(dp: int) -> None:
    # p=1, m=1: F (1) then BW (2); B bytes at bandwidth 1 per time unit
    schedule = generate("gpipe", 1, 1)
    share = (dp - 1) / dp * 10.0
    all_reduce = simulate(schedule, dp=dp, dp_bandwidth=1.0, param_bytes=10.0).data_parallel
    assert all_reduce is not None and all_reduce.reduce == "all-reduce"
    assert all_reduce.iteration_time == pytest.approx(3 + 2 * share)  # 2(N-1)/N B / bw after the last BW
    assert all_reduce.reductions() == [(0, 0, 3.0, pytest.approx(3 + 2 * share))]
    assert all_reduce.tail == [pytest.approx(2 * share)] and all_reduce.stall == [0.0]
    dist = simulate(schedule, collectives=DIST, dp=dp, dp_bandwidth=1.0, param_bytes=10.0).data_parallel
    assert dist is not None and dist.reduce == "reduce-scatter"
    # the parameter all-gather ((N-1)/N B / bw) gates the forward, then a reduce-scatter of the same size
    assert dist.stall == [pytest.approx(share)]
    assert dist.iteration_time == pytest.approx(share + 3 + share)
    fsdp = simulate(schedule, collectives=FSDP1, dp=dp, dp_bandwidth=1.0, param_bytes=10.0).data_parallel
    assert fsdp is not None and fsdp.gathers() == 1
    assert fsdp.iteration_time == pytest.approx(share + 3 + share)


def test_stream_runs_in_issue_order_and_drains() -> None:
    # p=1, v=2, m=2: chunk 1's reduction issued after its last BW, chunk 0's at the end; each takes 8
    schedule = generate("bfs", 1, 2, v=2)
    result = simulate(schedule, dp=2, dp_bandwidth=1.0, param_bytes=8.0)
    dp = result.data_parallel
    assert dp is not None
    (rank1, stage1, start1, end1), (rank0, stage0, start0, end0) = dp.reductions()
    assert (rank1, stage1, rank0, stage0) == (0, 1, 0, 0)
    assert (start1, end1) == (8.0, 16.0)  # 4 F, 2 BW of chunk 1 (4 time units) -> issued at 8
    assert start0 == end1 == 16.0 and end0 == 24.0  # issued at 12, waits for the stream
    assert dp.iteration_time == result.makespan == 24.0 and dp.tail == [12.0]
    assert dp.collectives[1][3] == 12.0  # issue time of chunk 0's reduction: the rank's last op ends


def test_gathers_delay_the_ops_that_need_them() -> None:
    schedule = generate("interleaved-1f1b", 2, 4, v=2)
    plain = simulate(schedule)
    result = simulate(schedule, collectives=FSDP1, dp=4, dp_bandwidth=1.0, param_bytes=1.0)
    dp = result.data_parallel
    assert dp is not None
    for rank in range(2):
        by_stage: dict[int, list[float]] = {}
        for r, kind, stage, _issued, _start, end in dp.collectives:
            if r == rank and kind == CollectiveKind.UNSHARD:
                by_stage.setdefault(stage, []).append(end)
        for op, start in zip(schedule.ops[rank], result.starts[rank], strict=True):
            done = [e for e in by_stage[op.stage] if e <= start + 1e-12]
            assert done, f"{op} starts before its chunk was gathered"
        assert all(a >= b for a, b in zip(result.starts[rank], plain.starts[rank], strict=True))
    assert sum(dp.stall) > 0


@pytest.mark.parametrize(("p", "m", "v"), [(4, 8, 2), (4, 12, 2), (4, 8, 4), (8, 16, 2)])
def test_breadth_first_exposes_less_than_interleaved(p: int, m: int, v: int) -> None:
    """The paper's setting: small batch per GPU, one chunk's reduction about one chunk's compute for
    the batch (3m unit ops), ring all-reduce over dp=8. (At m = p the two orders nearly coincide,
    see tests/schedules/test_bfs.py, and so do their exposed times.)"""
    chunk_bytes = 3 * m / (2 * 7 / 8)
    results = {}
    for name in ("bfs", "interleaved-1f1b"):
        schedule = generate(name, p, m, v=v)
        for fsdp in (False, True):
            policy = policy_for(schedule, fsdp=fsdp)
            results[name, fsdp] = simulate(
                schedule, collectives=policy, dp=8, dp_bandwidth=1.0, param_bytes=chunk_bytes
            )
    for fsdp in (False, True):
        bfs, inter = (results[n, fsdp].data_parallel for n in ("bfs", "interleaved-1f1b"))
        assert bfs is not None and inter is not None
        assert max(bfs.exposed) < max(inter.exposed), fsdp
        assert bfs.iteration_time < inter.iteration_time, fsdp
    bfs, inter = results["bfs", True].data_parallel, results["interleaved-1f1b", True].data_parallel
    assert bfs is not None and inter is not None and bfs.gathers() < inter.gathers()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dp": 2}, "needs dp_bandwidth"),
        ({"dp": 0, "dp_bandwidth": 1.0, "param_bytes": 1.0}, "dp .* must be an integer >= 1"),
        ({"dp": 2, "dp_bandwidth": 0.0, "param_bytes": 1.0}, "dp_bandwidth must be a finite number > 0"),
        ({"dp": 2, "dp_bandwidth": 1.0, "param_bytes": -1.0}, "must be finite and >= 0"),
        ({"dp": 2, "dp_bandwidth": 1.0, "param_bytes": 1.0, "comm": "blocking"}, "comm='async' only"),
    ],
)
def test_bad_dp_input(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        simulate(generate("1f1b", 2, 4), **kwargs)  # type: ignore[arg-type]


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(["bfs", "bfs-zb", "interleaved-1f1b", "1f1b", "zb-h1"]),
    p=st.integers(2, 4),
    m=st.integers(2, 8),
    size=st.floats(0.0, 20.0),
    dp=st.integers(2, 8),
    fsdp=st.booleans(),
    dist=st.booleans(),
)
def test_dp_only_delays(name: str, p: int, m: int, size: float, dp: int, fsdp: bool, dist: bool) -> None:
    try:
        schedule = generate(name, p, m, v=2 if name in ("bfs", "bfs-zb", "interleaved-1f1b") else None)
    except ValueError:
        return
    costs = Costs(1.0, 1.2, 0.8, None, 0.1)
    plain = simulate(schedule, costs)
    policy = policy_for(schedule, fsdp=fsdp, distributed_optimizer=dist)
    result = simulate(schedule, costs, collectives=policy, dp=dp, dp_bandwidth=1.0, param_bytes=size)
    dp_result = result.data_parallel
    assert dp_result is not None
    for rank in range(p):
        assert all(a >= b - 1e-9 for a, b in zip(result.starts[rank], plain.starts[rank], strict=True))
    assert dp_result.iteration_time >= plain.makespan - 1e-9
    previous_end = [0.0] * p
    for rank, _kind, _stage, issued, start, end in dp_result.collectives:  # rank by rank, issue order
        assert start >= issued - 1e-12 and end >= start
        assert start >= previous_end[rank] - 1e-12  # one stream per rank: in issue order, no overlap
        previous_end[rank] = end


def test_zeropp_reduce_scatters_per_unit_on_the_stream() -> None:
    """FSDP with ZeroPP's declared per-unit reduction: the stream carries v ceil(m/U) reduce-scatters per
    rank (each of a chunk's full size), more stream time than one per chunk, and never a shorter iteration."""
    from megatron_pp_ext.schedules.collectives import policy_for

    schedule = generate("zeropp", 4, 8, v=2, unit_size=2)
    kw = {"dp": 2, "dp_bandwidth": 1.0, "param_bytes": 0.5}
    unit = simulate(schedule, collectives=policy_for(schedule, fsdp=True), **kw).data_parallel
    once = simulate(schedule, collectives=policy_for(schedule, fsdp=True, grad_reduce_unit=8), **kw).data_parallel
    assert unit is not None and once is not None
    assert [unit.reduction_count(r) for r in range(4)] == [8] * 4
    assert [once.reduction_count(r) for r in range(4)] == [2] * 4
    assert unit.reduce == "reduce-scatter"
    assert len(unit.reductions()) == 32
    assert all(abs(b - a - 0.25) < 1e-12 for *_, a, b in unit.reductions())  # (2-1)/2 x 0.5 bytes at 1 byte/unit
    assert unit.stream_busy[0] - once.stream_busy[0] == pytest.approx(6 * 0.25)
    assert unit.iteration_time >= once.iteration_time - 1e-9
    assert unit.to_json_dict()["reduction_counts"] == [8] * 4
