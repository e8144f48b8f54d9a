"""Breadth-first looped schedules ``bfs`` and ``bfs-zb`` (Lamy-Poirier, MLSys 2023).

Unit costs (T_F = T_B = T_W = 1 per stage, BW = 2, no communication). Stages are the v*p small
stages of the loop placement: peak activations are counted in those stage units (``v`` of them
make one 1F1B activation M_a) and the bubble formula is in those units too.
"""

from __future__ import annotations

import pytest

from megatron_pp_ext.analysis.schedule_check import validate
from megatron_pp_ext.analysis.simulate import simulate
from megatron_pp_ext.schedules import OpKind, ScheduleError, generate, names
from megatron_pp_ext.schedules.costs import Costs
from megatron_pp_ext.schedules.generators.baselines import interleaved_warmup
from megatron_pp_ext.schedules.generators.bfs import FSDP_MAX_UNSHARDED
from megatron_pp_ext.schedules.generators.common import ScheduleParameterError
from tests.tiers import slow_params


def groups_of(p: int, m: int) -> list[int]:
    return sorted({1, min(p, m), max(1, m // 2), m})


GRID = [
    (p, m, v, g) for p in (1, 2, 3, 4, 5, 8) for m in range(1, 2 * p + 3) for v in (1, 2, 3) for g in groups_of(p, m)
]


@pytest.mark.parametrize("name", slow_params(["bfs", "bfs-zb"], {"bfs", "bfs-zb"}))
def test_valid_and_deadlock_free_over_the_grid(name: str) -> None:
    # includes m < p, m % p != 0 and groups that do not divide m (the last group is smaller)
    for p, m, v, g in GRID:
        schedule = generate(name, p, m, v=v, microbatch_group_size=g)
        lowered = validate(schedule)  # placement, completeness, dependencies, rendezvous deadlock freedom
        assert len(lowered.programs) == p
        assert schedule.chunks_per_rank == v
        assert schedule.params["microbatch_group_size"] == g
        assert schedule.splits_backward == (name == "bfs-zb")


def test_registered_with_defaults() -> None:
    assert {"bfs", "bfs-zb"} <= set(names())
    schedule = generate("bfs", 4, 8)
    assert schedule.chunks_per_rank == 2  # default v
    assert schedule.params["microbatch_group_size"] == 8  # default: pure breadth-first


def test_pure_order_is_the_papers() -> None:
    # rank r: F of every micro-batch on chunk 0 (stage r), then chunk 1 (stage p+r); backwards reversed
    schedule = generate("bfs", 2, 3, v=2)
    assert [str(op) for op in schedule.ops[1]] == (
        "F1.0 F1.1 F1.2 F3.0 F3.1 F3.2 BW3.0 BW3.1 BW3.2 BW1.0 BW1.1 BW1.2".split()
    )


def bfs_bubble(p: int, m: int, v: int) -> float:
    """Unit costs, pure bfs: the forward pass of rank 0 waits ``p - m`` per chunk turn when m < p.

    makespan = 3 (v max(m, p) + min(m, p) - 1): for m >= p, 3 (v m + p - 1), i.e. the
    REFERENCES formula (p-1)/(v m + p-1)."""
    return 1 - v * m / (v * max(m, p) + min(m, p) - 1)


@pytest.mark.parametrize("p", range(2, 9))
def test_unit_cost_bubble_exact(p: int) -> None:
    bad = []
    for m in range(1, 4 * p + 1):
        for v in range(1, 5):
            result = simulate(generate("bfs", p, m, v=v), Costs.unit())
            expected = bfs_bubble(p, m, v)
            if m >= p:
                assert expected == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-12)
            got = (result.bubble_rate, result.sync_bubble_rate)
            if got != pytest.approx((expected, expected), rel=1e-12, abs=1e-12):
                bad.append((m, v, got, expected))
            # every micro-batch of every chunk alive at the turn: v m stage units = m 1F1B units
            assert result.peak_activations == [v * m] * p
            assert result.peak_activations_1f1b_units == pytest.approx([m] * p)
    assert not bad, bad


@pytest.mark.parametrize(("p", "m", "v", "g"), [(4, 8, 2, 4), (4, 6, 2, 4), (4, 12, 3, 4), (3, 7, 2, 2)])
def test_hybrid_groups_memory_and_bubble(p: int, m: int, v: int, g: int) -> None:
    result = simulate(generate("bfs", p, m, v=v, microbatch_group_size=g), Costs.unit())
    assert result.peak_activations == [v * g] * p  # one group alive: g 1F1B units
    sizes = [min(g, m - start) for start in range(0, m, g)]
    # groups run one after another, each a pure breadth-first pipeline of its own
    assert result.makespan == pytest.approx(sum(3 * (v * max(k, p) + min(k, p) - 1) for k in sizes))
    assert result.sync_bubble_rate > simulate(generate("bfs", p, m, v=v)).sync_bubble_rate


@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 2), (4, 4, 2), (4, 8, 2), (4, 8, 3), (4, 12, 2), (8, 16, 2)])
def test_group_p_against_interleaved_1f1b(p: int, m: int, v: int) -> None:
    """The claim "group = p reproduces interleaved 1F1B's order": the per-rank forward order and the
    per-rank backward order are exactly interleaved-1f1b's (microbatch_group_size = p); the merged
    order is the same only on ranks whose 1F1B warm-up already covers every forward
    (2(p-r-1) + (v-1)p >= v m): bfs runs the groups one after another, interleaved-1f1b overlaps
    a group's backwards with the next group's forwards."""
    ours = generate("bfs", p, m, v=v, microbatch_group_size=p)
    megatron = generate("interleaved-1f1b", p, m, v=v, microbatch_group_size=p)
    for r in range(p):
        for kind in (OpKind.F, OpKind.BW):
            assert [op for op in ours.ops[r] if op.kind == kind] == [op for op in megatron.ops[r] if op.kind == kind]
        covers = interleaved_warmup(p, r, m, v, p) == m * v
        assert (ours.ops[r] == megatron.ops[r]) == covers, r


@pytest.mark.parametrize("p", range(2, 7))
def test_bfs_zb_fills_the_cool_down(p: int) -> None:
    for m in range(1, 3 * p + 1):
        for v in (1, 2, 3):
            zb = simulate(generate("bfs-zb", p, m, v=v), Costs.unit())
            plain = simulate(generate("bfs", p, m, v=v), Costs.unit())
            assert zb.peak_activations == plain.peak_activations  # W deferral stays within the turn's peak
            assert zb.makespan < plain.makespan
            if m >= p:
                # derived: the B chain returns in (p-1) T_B instead of (p-1)(T_B+T_W); the idle 2(p-1)
                # at the turn cannot be filled (no B has run yet on that rank)
                assert zb.sync_bubble_rate == pytest.approx(2 * (p - 1) / (3 * v * m + 2 * (p - 1)), rel=1e-12)


def test_bfs_zb_w_never_delays_f_or_b_with_costs() -> None:
    costs = Costs(1.0, 1.5, 0.7, None, 0.1)
    for p, m, v in [(4, 3, 2), (4, 8, 2), (3, 5, 3)]:
        zb = simulate(generate("bfs-zb", p, m, v=v, costs=costs), costs)
        no_w = [[op for op in row if op.kind != OpKind.W] for row in zb.ops]
        b_only = simulate(generate("bfs-zb", p, m, v=v, costs=Costs(1.0, 1.5, 1e9, None, 0.1)), costs)
        # with W too long to fit anywhere every W goes to the end: the F/B timing is the reference
        assert [[op for op in row if op.kind != OpKind.W] for row in b_only.ops] == no_w
        for r in range(p):
            ref = {str(op): t for op, t in zip(b_only.ops[r], b_only.starts[r], strict=True) if op.kind != OpKind.W}
            got = {str(op): t for op, t in zip(zb.ops[r], zb.starts[r], strict=True) if op.kind != OpKind.W}
            assert got == pytest.approx(ref)


def test_fsdp_policy_is_declared() -> None:
    for name in ("bfs", "bfs-zb"):
        assert generate(name, 4, 8, v=2).params["fsdp_max_unsharded"] == FSDP_MAX_UNSHARDED == 1


@pytest.mark.parametrize("name", ["bfs", "bfs-zb"])
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"microbatch_group_size": 0}, r"microbatch_group_size must be >= 1"),
        ({"microbatch_group_size": 9}, r"microbatch_group_size .* must be in 1\.\.m = 1\.\.8, got 9"),
        ({"microbatch_group_size": 2.5}, r"microbatch_group_size must be an integer"),
        ({"v": 0}, r"v must be >= 1"),
        ({"memory_limit": 4}, r"does not take parameter\(s\) memory_limit"),
    ],
)
def test_bad_parameters(name: str, kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ScheduleParameterError, match=match):
        generate(name, 4, 8, **kwargs)
    assert issubclass(ScheduleParameterError, ScheduleError)
