"""BitPipe (``bitpipe``, ``bitpipe-zb``): the paper's Figure 3, validity, replica collectives,
exact bubble and peak activations.

Figures are the simulator's. Memory is in stage activations of the bidirectional placement
(one stage = L/(2p) layers = half a 1F1B stage, "half-stage units"). Timing tables live in
benchmarks/RESULTS.md ("BitPipe (simulator)").
"""

from __future__ import annotations

import functools

import pytest

from megatron_pp_ext.analysis.schedule_check import validate
from megatron_pp_ext.analysis.simulate import SimResult, simulate
from megatron_pp_ext.schedules import ScheduleError, generate, get, names
from megatron_pp_ext.schedules.collectives import (
    CollectiveKind,
    CollectivePolicy,
    check_collectives,
    derive_collectives,
)
from megatron_pp_ext.schedules.costs import Costs
from megatron_pp_ext.schedules.generators.bitpipe import bitpipe_rounds, warmup_forwards
from megatron_pp_ext.schedules.generators.common import ScheduleParameterError
from megatron_pp_ext.schedules.ir import OpKind
from megatron_pp_ext.schedules.schedule import Schedule

NAMES = ("bitpipe", "bitpipe-zb")
GRID = [(p, m) for p in (2, 4, 8, 16) for m in range(p, 4 * p + 1, p)]
EQUAL_F_BW = Costs(1.0, 1.0, 1.0, t_bw=1.0)  # the derived formula's "equal F and B" (B = full backward)


@functools.lru_cache(maxsize=128)
def sim(name: str, p: int, m: int, costs: Costs | None = None) -> SimResult:
    return simulate(generate(name, p, m), costs)


def test_registered() -> None:
    assert set(NAMES) <= set(names())
    assert get("bitpipe").placement == get("bitpipe-zb").placement == "bidirectional"
    assert not get("bitpipe").splits_backward and get("bitpipe-zb").splits_backward


# ---- Figure 3 of the paper (p = 4, m = 4) -------------------------------------------------------
# Transcribed from the authors' figure (docs/BitPipe_images/BitPipe-v.svg in their repository):
# per device, each pass as <F|B><leg 1|2><d(own)|u(p)><micro-batch 1..4> at its start slot, with a
# forward taking 1 slot and a backward 2. Leg 1 is the first half of a replica's V, leg 2 the way back.
FIGURE_3 = {
    0: "0F1d1 2F1d2 3F1u3 4F2u3 5F1u4 6F2u4 7F2d1 8B2d1 10F2d2 12B2d2 14B2u3 16B1u3 18B2u4 20B1u4 22B1d1 26B1d2",
    1: "1F1d1 2F1u3 3F1d2 4F1u4 5F2u3 6F2d1 7F2u4 8F2d2 10B2d1 12B2u3 14B2d2 16B2u4 18B1u3 20B1d1 22B1u4 24B1d2",
    2: "1F1u3 2F1d1 3F1u4 4F1d2 5F2d1 6F2u3 7F2d2 8F2u4 10B2u3 12B2d1 14B2u4 16B2d2 18B1d1 20B1u3 22B1d2 24B1u4",
    3: "0F1u3 2F1u4 3F1d1 4F2d1 5F1d2 6F2d2 7F2u3 8B2u3 10F2u4 12B2u4 14B2d1 16B1d1 18B2d2 20B1d2 22B1u3 26B1u4",
}


def _figure_cell(p: int, rank: int, cell: str) -> tuple[float, str]:
    slot, kind, leg, way, mb = int(cell[:-4]), cell[-4], cell[-3], cell[-2], int(cell[-1]) - 1
    s = 2 * p
    stage = {
        ("d", "1"): rank,
        ("d", "2"): 2 * p - 1 - rank,
        ("u", "1"): s + p - 1 - rank,
        ("u", "2"): s + p + rank,
    }[(way, leg)]
    return float(slot), f"{'F' if kind == 'F' else 'BW'}{stage}.{mb}"


def test_figure_3_op_for_op() -> None:
    schedule = generate("bitpipe", 4, 4)
    result = simulate(schedule, Costs(1.0, 1.0, 1.0))  # T_BW = T_B + T_W = 2 T_F, as drawn
    assert schedule.microbatch_replicas == (0, 0, 1, 1)  # micro-batches 1, 2 down; 3, 4 up
    for rank, cells in FIGURE_3.items():
        slots, ops = zip(*(_figure_cell(4, rank, cell) for cell in cells.split()), strict=True)
        assert [str(op) for op in schedule.ops[rank]] == list(ops), rank
        # Same times on ranks 1, 2. On the edge ranks the figure holds the second injection back one
        # slot (so that the directions alternate from the start) and the simulator starts it at once,
        # so that micro-batch's last-stage F -> BW turn also comes one slot earlier; nothing else moves.
        moved = {i: slots[i] - a for i, a in enumerate(result.starts[rank]) if a != slots[i]}
        assert moved == ({1: 1.0, 9: 1.0} if rank in (0, 3) else {}), rank
    assert result.makespan == 28.0


def test_figure_3_warmup_counts() -> None:
    # Figure 3 runs 7, 8, 8, 7 forwards before the first backward; REFERENCES' derived warm-up
    # p + p/2 + min(r, p-1-r) = 6, 7, 7, 6 counts them without the first steady-state forward.
    schedule = generate("bitpipe", 4, 4)
    before_first_backward = [next(i for i, op in enumerate(row) if op.kind == OpKind.BW) for row in schedule.ops]
    assert before_first_backward == [7, 8, 8, 7]
    assert [warmup_forwards(4, r) + 1 for r in range(4)] == before_first_backward


# ---- validity -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("p", "m"), GRID)
def test_valid_and_deadlock_free(name: str, p: int, m: int) -> None:
    schedule = generate(name, p, m)
    validate(schedule)
    assert schedule.microbatch_replicas == bitpipe_rounds(p, m)
    assert schedule.microbatch_replicas.count(0) == schedule.microbatch_replicas.count(1) == m // 2
    assert schedule.chunks_per_rank == 4
    for rank, row in enumerate(schedule.ops):  # every rank: 2m forwards, 2m backwards
        assert sum(op.kind == OpKind.F for op in row) == 2 * m, rank


@pytest.mark.parametrize(("p", "m"), [(4, 8), (8, 16)])
def test_directions_are_mirror_images(p: int, m: int) -> None:
    # rank r's program is rank p-1-r's with the replicas swapped (the same op kinds, in order)
    schedule = generate("bitpipe", p, m)
    placement = schedule.placement
    for r in range(p):
        mine = [(op.kind, placement.chunk_of(op.stage) ^ 1) for op in schedule.ops[r]]
        theirs = [(op.kind, placement.chunk_of(op.stage)) for op in schedule.ops[p - 1 - r]]
        assert mine == theirs, r


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(("p", "m"), GRID)
def test_replica_sync_collectives(name: str, p: int, m: int) -> None:
    schedule = generate(name, p, m)
    plan = derive_collectives(schedule, CollectivePolicy(replica_sync=True))
    check_collectives(plan)
    for rank in range(p):
        assert plan.count(CollectiveKind.REPLICA_SYNC, rank) == 4
        assert plan.count(CollectiveKind.REDUCE_GRADS, rank) == 4


@pytest.mark.parametrize(("p", "m"), [(4, 4), (4, 8), (8, 16)])
def test_eager_sync_on_edge_ranks(p: int, m: int) -> None:
    # Rank 0 finishes the backwards of its second-half chunks (2: stage 2p-1 of the down replica,
    # 3: stage p of the up one) before the end: their replica all-reduce can start in the cool-down.
    schedule = generate("bitpipe", p, m)
    plan = derive_collectives(schedule, CollectivePolicy(reduce_grads=False, replica_sync=True))
    end = len(schedule.ops[0])
    early = {schedule.placement.chunk_of(c.stage) for gap, c in plan.at[0] if gap < end}
    assert {2, 3} <= early


def test_replica_sync_order_break_is_caught() -> None:
    schedule = generate("bitpipe", 4, 8)
    plan = derive_collectives(schedule, CollectivePolicy(reduce_grads=False, replica_sync=True))
    swapped = list(plan.at)
    swapped[0] = (swapped[0][1], swapped[0][0], *swapped[0][2:])
    with pytest.raises(ScheduleError, match="different orders"):
        check_collectives(type(plan)(plan.schedule, plan.policy, tuple(swapped)))


# ---- bubble -----------------------------------------------------------------------------------------
def idle_time(p: int, m: int, t_f: float, t_bw: float) -> float:
    """Idle time of every rank under ``bitpipe`` (derived from the schedule's structure, checked below):
    ``(p-2) max(T_F, T_BW)`` for one round, plus ``(p-2)|T_BW - T_F|`` per further round."""
    return (p - 2) * (max(t_f, t_bw) + (m // p - 1) * abs(t_bw - t_f))


@pytest.mark.parametrize(("p", "m"), GRID)
def test_bubble_equals_derived_formula_with_equal_f_and_bw(p: int, m: int) -> None:
    result = sim("bitpipe", p, m, EQUAL_F_BW)
    assert result.bubble_rate == pytest.approx((p - 2) / (4 * m + p - 2), abs=1e-12)


@pytest.mark.parametrize(("p", "m"), GRID)
@pytest.mark.parametrize(("t_f", "t_bw"), [(1.0, 2.0), (1.0, 3.0), (3.0, 2.0)])
def test_idle_time_with_unequal_costs(p: int, m: int, t_f: float, t_bw: float) -> None:
    # Unit costs (T_F = T_B = T_W = 1, so T_BW = 2) are the (1, 2) case: the derived formula's
    # assumption T_F = T_BW fails, the first round idles (p-2) T_BW and every round hand-over adds
    # (p-2)(T_BW - T_F), so the bubble no longer falls like 1/m.
    result = sim("bitpipe", p, m, Costs(t_f, 1.0, 1.0, t_bw=t_bw))
    busy = 2 * m * (t_f + t_bw)
    assert result.makespan == pytest.approx(busy + idle_time(p, m, t_f, t_bw))
    assert max(result.span) == result.makespan  # both bubble definitions agree
    assert result.busy == [busy] * p


@pytest.mark.parametrize(("p", "m"), [(p, m) for p, m in GRID if p > 2])
def test_split_variant_fills_the_cool_down(p: int, m: int) -> None:
    whole, split = sim("bitpipe", p, m), sim("bitpipe-zb", p, m)
    assert split.bubble_rate < whole.bubble_rate / 2
    assert split.peak_activations == whole.peak_activations


# ---- memory ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("p", "m"), GRID)
def test_peak_activations_per_rank(p: int, m: int) -> None:
    derived = [3 * p / 2 + 1 + min(r, p - 1 - r) for r in range(p)]  # half-stage units
    assert sim("bitpipe", p, m).peak_activations == derived
    assert sim("bitpipe", p, m).peak_activations_1f1b_units == [x / 2 for x in derived]


# ---- bad input ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    ("p", "m", "match"),
    [
        (3, 6, r"even pipeline size -p/--pipeline-model-parallel-size \(2, 4, 6, \.\.\.\).*p=3"),
        (1, 2, r"-p/--pipeline-model-parallel-size\) must be >= 2"),
        (4, 6, r"-m \(number of micro-batches\) to be a multiple of p=4.*m=6; valid: 4, 8, 12"),
        (4, 2, r"multiple of p=4.*m=2"),
        (4, 0, r"m must be >= 1, got 0"),  # the declared capabilities check m before the generator
        (4, 4.0, r"must be an integer"),
    ],
)
def test_bad_input(name: str, p: int, m: int, match: str) -> None:
    with pytest.raises(ScheduleParameterError, match=match):
        generate(name, p, m)


def test_rejects_other_parameters() -> None:
    with pytest.raises(ScheduleParameterError, match="v must be 4"):
        generate("bitpipe", 4, 4, v=2)
    with pytest.raises(ScheduleParameterError, match="memory_limit"):
        generate("bitpipe-zb", 4, 4, memory_limit=3)
    assert isinstance(generate("bitpipe", 4, 4, v=4), Schedule)
