"""Data-parallel / FSDP collectives derived from the op order (schedules/collectives.py), on the
breadth-first schedules and against the baselines; check_collectives rejects broken plans."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_pp_ext.schedules import BW, F, OpKind, Schedule, ScheduleError, generate, loop_placement
from megatron_pp_ext.schedules.collectives import (
    Collective,
    CollectiveKind,
    CollectivePlan,
    CollectivePolicy,
    check_collectives,
    declared_fsdp_limit,
    derive_collectives,
    policy_for,
    reduces_by_scatter,
)

RS, UN, RE, PS = CollectiveKind.REDUCE_GRADS, CollectiveKind.UNSHARD, CollectiveKind.RESHARD, CollectiveKind.PARAM_SYNC
FSDP1 = CollectivePolicy(fsdp_max_unsharded=1)


def grid() -> list[tuple[int, int, int, int]]:
    return [
        (p, m, v, g)
        for p in (1, 2, 3, 4, 5)
        for m in range(1, 2 * p + 3)
        for v in (1, 2, 3)
        for g in sorted({1, min(p, m), m})
    ]


@pytest.mark.parametrize("name", ["bfs", "bfs-zb"])
def test_every_chunk_reduced_once_after_its_last_backward(name: str) -> None:
    for p, m, v, g in grid():
        schedule = generate(name, p, m, v=v, microbatch_group_size=g)
        plan = derive_collectives(schedule, CollectivePolicy(param_sync=True, fsdp_max_unsharded=1))
        check_collectives(plan)
        for r in range(p):
            reduces = [(gap, c.stage) for gap, c in plan.at[r] if c.kind == RS]
            assert sorted(s for _, s in reduces) == list(schedule.placement.stages_on_rank(r))
            ops = schedule.ops[r]
            for gap, stage in reduces:
                grad_ops = [i for i, op in enumerate(ops) if op.stage == stage and op.kind != OpKind.F]
                assert gap == grad_ops[-1] + 1  # right after the chunk's last gradient op
            if g == m and v > 1:
                # breadth-first: chunk v-1's reduction starts m backwards into the backward pass,
                # (v-1) m backwards before the rank's last one (the overlap the paper is about)
                first = min(gap for gap, _ in reduces)
                if name == "bfs":
                    assert first == v * m + m == len(ops) - (v - 1) * m
                assert first < len(ops)  # issued before the last backward runs
            assert plan.count(PS, r) == v  # one parameter gather per chunk


def bfs_gathers(v: int, groups: int) -> int:
    """FSDP unshards per rank per iteration, limit 1: per group one gather per forward sweep and one
    per backward sweep, except that the last chunk stays gathered across the turn (F sweep of
    chunk v-1 then its B sweep) and chunk 0 across the group boundary (B sweep then the next F sweep)."""
    return groups * (2 * v - 1) - (groups - 1)


@pytest.mark.parametrize("name", ["bfs", "bfs-zb"])
def test_fsdp_gathers_once_per_sweep(name: str) -> None:
    for p, m, v, g in grid():
        schedule = generate(name, p, m, v=v, microbatch_group_size=g)
        limit = declared_fsdp_limit(schedule)
        assert limit == 1
        plan = derive_collectives(schedule, CollectivePolicy(fsdp_max_unsharded=limit))
        check_collectives(plan)
        groups = -(-m // g)
        for r in range(p):
            assert plan.count(UN, r) == plan.count(RE, r) == bfs_gathers(v, groups), (p, m, v, g, r)


@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 2), (4, 8, 2), (4, 16, 2), (4, 8, 4), (8, 16, 2)])
def test_fsdp_gathers_bfs_vs_interleaved(p: int, m: int, v: int) -> None:
    bfs = derive_collectives(generate("bfs", p, m, v=v), FSDP1)
    interleaved = derive_collectives(generate("interleaved-1f1b", p, m, v=v), FSDP1)
    check_collectives(interleaved)
    assert [bfs.count(UN, r) for r in range(p)] == [2 * v - 1] * p  # about 2 per chunk, independent of m
    # interleaved 1F1B switches chunks about every op of its steady state: on average more than one
    # gather per micro-batch on a rank, growing with m (the last rank, whose warm-up is (v-1)p
    # forwards, switches least)
    gathers = [interleaved.count(UN, r) for r in range(p)]
    assert sum(gathers) > p * m
    assert min(gathers) > 2 * v - 1
    bigger = derive_collectives(generate("interleaved-1f1b", p, 2 * m, v=v), FSDP1)
    assert sum(bigger.count(UN, r) for r in range(p)) > sum(gathers)


def test_policy_for() -> None:
    bfs = generate("bfs", 4, 8, v=2)
    assert policy_for(bfs, fsdp=True) == CollectivePolicy(fsdp_max_unsharded=1)
    assert policy_for(bfs, fsdp=True, fsdp_max_unsharded=2).fsdp_max_unsharded == 2
    assert policy_for(generate("interleaved-1f1b", 4, 8, v=2), fsdp=True).fsdp_max_unsharded == 1  # default
    dist = policy_for(bfs, distributed_optimizer=True)
    assert dist.param_sync and dist.fsdp_max_unsharded is None and reduces_by_scatter(dist)
    assert not reduces_by_scatter(policy_for(bfs))
    assert not policy_for(bfs, fsdp=True, distributed_optimizer=True).param_sync  # FSDP gathers anyway
    with pytest.raises(ScheduleError, match="fsdp_max_unsharded is an FSDP setting"):
        policy_for(bfs, fsdp_max_unsharded=2)


# ---- check_collectives rejects broken plans ----------------------------------------------------------
def _plan() -> CollectivePlan:
    return derive_collectives(generate("bfs", 2, 3, v=2), CollectivePolicy(fsdp_max_unsharded=1))


def _edit(plan: CollectivePlan, rank: int, items: list[tuple[int, Collective]]) -> CollectivePlan:
    at = list(plan.at)
    at[rank] = tuple(sorted(items, key=lambda x: x[0]))
    return replace(plan, at=tuple(at))


def _without(plan: CollectivePlan, rank: int, kind: CollectiveKind, nth: int = 0) -> list[tuple[int, Collective]]:
    items = list(plan.at[rank])
    hits = [i for i, (_, c) in enumerate(items) if c.kind == kind]
    del items[hits[nth]]
    return items


def test_check_rejects_a_missing_reduction() -> None:
    plan = _plan()
    with pytest.raises(ScheduleError, match=r"rank 1: chunks \[1\] never reduce their gradients"):
        check_collectives(_edit(plan, 1, _without(plan, 1, RS, nth=1)))


def test_check_rejects_a_double_reduction() -> None:
    plan = _plan()
    items = list(plan.at[0])
    gap, reduce = next((g, c) for g, c in items if c.kind == RS)
    with pytest.raises(ScheduleError, match="issued twice"):
        check_collectives(_edit(plan, 0, [*items, (gap + 1, reduce)]))


def test_check_rejects_an_early_reduction() -> None:
    plan = _plan()
    items = list(plan.at[0])
    k = next(i for i, (_, c) in enumerate(items) if c.kind == RS)
    items[k] = (items[k][0] - 1, items[k][1])
    with pytest.raises(ScheduleError, match="before the chunk's last gradient op"):
        check_collectives(_edit(plan, 0, items))


def test_check_rejects_a_use_without_gather() -> None:
    plan = _plan()
    with pytest.raises(ScheduleError, match="runs while its chunk is sharded"):
        check_collectives(_edit(plan, 0, _without(plan, 0, UN, nth=1)))


def test_check_rejects_too_many_gathered_chunks() -> None:
    plan = _plan()
    with pytest.raises(ScheduleError, match=r"2 chunks gathered at gap .*, limit 1"):
        check_collectives(_edit(plan, 0, _without(plan, 0, RE, nth=0)))


def test_check_rejects_a_chunk_left_gathered() -> None:
    plan = _plan()
    with pytest.raises(ScheduleError, match="still gathered at the end of the iteration"):
        check_collectives(_edit(plan, 1, _without(plan, 1, RE, nth=-1)))


def test_check_rejects_a_foreign_stage() -> None:
    plan = _plan()
    with pytest.raises(ScheduleError, match="names a stage this rank does not hold"):
        check_collectives(_edit(plan, 0, [*plan.at[0], (0, Collective(CollectiveKind.REDUCE_GRADS, 1))]))


# ---- property: random per-rank orders ---------------------------------------------------------------
def random_schedule(p: int, m: int, v: int, seed: int) -> Schedule:
    """A random per-rank order that respects each rank's own dependencies (F before its BW, F of a
    chunk's micro-batch after the earlier chunk's, backwards the other way): enough for collectives."""
    rng = random.Random(seed)
    rows = []
    for r in range(p):
        stages = [c * p + r for c in range(v)]
        todo = [(F(s, i), BW(s, i)) for s in stages for i in range(m)]
        done: set[object] = set()
        row = []
        while len(row) < 2 * len(todo):
            ready = []
            for f, bw in todo:
                c = f.stage // p
                if f not in done and (c == 0 or F(f.stage - p, f.microbatch) in done):
                    ready.append(f)
                elif f in done and bw not in done and (c == v - 1 or BW(f.stage + p, f.microbatch) in done):
                    ready.append(bw)
            op = rng.choice(ready)
            done.add(op)
            row.append(op)
        rows.append(row)
    return Schedule(loop_placement(p, v), m, tuple(tuple(row) for row in rows), name="random")


def fewest_gathers(uses: list[int], limit: int) -> int:
    """Brute force: the fewest gathers serving ``uses`` with at most ``limit`` chunks gathered."""
    best: dict[frozenset[int], int] = {frozenset(): 0}
    for stage in uses:
        step: dict[frozenset[int], int] = {}
        for held, cost in best.items():
            if stage in held:
                options = [(held, cost)]
            else:
                keep = [held] if len(held) < limit else [held - {x} for x in held]
                options = [(k | {stage}, cost + 1) for k in keep]
            for state, c in options:
                step[state] = min(c, step.get(state, c))
        best = step
    return min(best.values())


@settings(max_examples=60, deadline=None)
@given(
    p=st.integers(1, 4),
    m=st.integers(1, 5),
    v=st.integers(1, 3),
    seed=st.integers(0, 10**6),
    limit=st.integers(1, 3),
    param_sync=st.booleans(),
)
def test_random_orders_derive_checked_plans(p: int, m: int, v: int, seed: int, limit: int, param_sync: bool) -> None:
    schedule = random_schedule(p, m, v, seed)
    plan = derive_collectives(schedule, CollectivePolicy(param_sync=param_sync, fsdp_max_unsharded=limit))
    check_collectives(plan)
    counts = [
        derive_collectives(schedule, CollectivePolicy(fsdp_max_unsharded=k)).count(UN, 0) for k in range(1, v + 1)
    ]
    assert counts == sorted(counts, reverse=True)  # Belady's rule: more room never means more gathers
    uses = [op.stage for op in schedule.ops[0] if op.kind != OpKind.W]
    assert counts == [fewest_gathers(uses, k) for k in range(1, v + 1)]  # ... and is optimal
    assert counts[-1] == v  # room for every chunk: each gathered exactly once
    assert plan.count(RS) == p * v


# ---- gradient reductions per unit (FSDP; ZeroPP declares its unit size) -------------------------------
@pytest.mark.parametrize(
    ("p", "m", "v", "unit"), [(2, 4, 2, 1), (2, 4, 2, 2), (2, 5, 2, 2), (4, 8, 2, 1), (3, 7, 3, 3)]
)
def test_zeropp_reduces_each_chunk_once_per_unit(p: int, m: int, v: int, unit: int) -> None:
    schedule = generate("zeropp", p, m, v=v, unit_size=unit)
    policy = policy_for(schedule, fsdp=True)
    assert policy.grad_reduce_unit == unit  # declared by the schedule
    plan = derive_collectives(schedule, policy)
    check_collectives(plan)
    for rank, ops in enumerate(schedule.ops):
        reduces = [(gap, c.stage) for gap, c in plan.at[rank] if c.kind == RS]
        assert len(reduces) == v * -(-m // unit)  # every chunk, every unit
        for gap, stage in reduces:  # right after a gradient op of that chunk, the last of its unit
            op = ops[gap - 1]
            assert op.stage == stage and op.kind in (OpKind.B, OpKind.W, OpKind.BW)
            later = [o for o in ops[gap:] if o.stage == stage and o.kind != OpKind.F]
            assert all(o.microbatch // unit != op.microbatch // unit for o in later)


def test_one_unit_or_no_fsdp_reduces_once_per_iteration() -> None:
    whole = generate("zeropp", 2, 4, v=2, unit_size=4)
    assert policy_for(whole, fsdp=True).grad_reduce_unit is None  # U = m: the plain reduction
    small = generate("zeropp", 2, 4, v=2, unit_size=1)
    assert policy_for(small, fsdp=True, grad_reduce_unit=4).grad_reduce_unit is None  # override: per iteration
    assert policy_for(small).grad_reduce_unit is None  # all-reduce: per unit would only move more data
    assert derive_collectives(small, policy_for(small)).count(RS, 0) == 2
    with pytest.raises(ScheduleError, match="grad_reduce_unit is an FSDP setting"):
        policy_for(small, grad_reduce_unit=2)
    with pytest.raises(ScheduleError, match="grad_reduce_unit is an FSDP setting"):
        CollectivePolicy(grad_reduce_unit=2)
    with pytest.raises(ScheduleError, match="grad_reduce_unit must be an integer >= 1"):
        CollectivePolicy(fsdp_max_unsharded=1, grad_reduce_unit=0)


def test_check_rejects_a_missing_or_misplaced_unit_reduction() -> None:
    schedule = generate("zeropp", 2, 4, v=2, unit_size=2)
    plan = derive_collectives(schedule, policy_for(schedule, fsdp=True))
    with pytest.raises(ScheduleError, match=r"rank 0: chunk s\d reduces 1 of its 2 units' gradients"):
        check_collectives(_edit(plan, 0, _without(plan, 0, RS, nth=0)))
    items = list(plan.at[0])
    k = next(i for i, (_, c) in enumerate(items) if c.kind == RS)
    items[k] = (items[k][0] + 1, items[k][1])  # one op late
    with pytest.raises(ScheduleError, match="due once right after the chunk's last gradient op of each unit"):
        check_collectives(_edit(plan, 0, items))
    # the once-per-iteration plan of the same schedule is not a per-unit plan
    once = derive_collectives(schedule, policy_for(schedule, fsdp=True, grad_reduce_unit=4))
    with pytest.raises(ScheduleError, match="units' gradients"):
        check_collectives(replace(once, policy=plan.policy))
