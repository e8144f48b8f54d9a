"""torch.distributed.pipelining's orders imported into our IR: letters, V numbering, 1F1B repair, known bubbles."""

from __future__ import annotations

import pytest

from megatron_pp_ext.analysis import simulate
from megatron_pp_ext.analysis.peers import PeerRow, stage_costs, torch_better
from megatron_pp_ext.analysis.schedule_check import validate
from megatron_pp_ext.analysis.torch_orders import TORCH_SCHEDULES, import_order, parse_action
from megatron_pp_ext.schedules import generate
from megatron_pp_ext.schedules.costs import Costs
from megatron_pp_ext.schedules.ir import BW, B, F, ScheduleError, W


def test_action_letters_map_to_ours() -> None:
    assert parse_action("3F1") == [F(3, 1)]
    assert parse_action("4I0") == [B(4, 0)]  # torch I = input-gradient backward = our B
    assert parse_action("7W2") == [W(7, 2)]
    assert parse_action("0B5") == [BW(0, 5)]  # torch B = full backward = our BW
    assert parse_action("(0F7;7B3)OVERLAP_F_B") == [F(0, 7), BW(7, 3)]
    for skipped in ("0REDUCE_GRAD", "1SEND_F0", "2RECV_B3", "0UNSHARD", "", None):
        assert parse_action(skipped) is None
    with pytest.raises(ScheduleError):
        parse_action("F3")


def test_single_stage_order_with_last_rank_numbered_from_one_is_repaired() -> None:
    # torch 2.13's Schedule1F1B pipeline_order at p=2, m=3: the last rank's forwards are 1..3.
    order = [
        ["0F0", None, "0F1", "0B0", "0F2", "0B1", None, "0B2", "0REDUCE_GRAD"],
        [None, "1F1", "1B0", "1F2", "1B1", "1F3", "1B2", "1REDUCE_GRAD"],
    ]
    imported = import_order(order, 3)
    assert imported.repaired_ranks == (1,)
    assert imported.schedule.ops == generate("1f1b", 2, 3).ops
    validate(imported.schedule)


def test_v_numbering_becomes_our_v_placement() -> None:
    # rank r holds stages r and 2p-1-r (torch's ZBV / DualPipeV numbering), p=2, m=1
    order = [["0F0", "3F0", "3B0", "0B0"], ["1F0", "2F0", "2B0", "1B0"]]
    schedule = import_order(order, 1).schedule
    assert schedule.placement.style == "v"
    assert simulate(schedule).makespan == 12.0  # serial chain of 4 F and 4 BW, unit costs


def test_order_on_unknown_stage_map_is_refused() -> None:
    with pytest.raises(ScheduleError, match="neither looped"):
        import_order([["0F0", "1F0", "1B0", "0B0"], ["2F0", "3F0", "3B0", "2B0"]], 1)  # blocks: 0,1 | 2,3


def test_torch_better_lists_a_faster_torch_row_and_nothing_else() -> None:
    def row(name: str, side: str, makespan: float, peak: float) -> PeerRow:
        return PeerRow(4, 8, "unit", "X", name, side, makespan, 0.0, 0.0, peak, 0)

    faster = [row("torch:X", "torch", 9.0, 4), row("ours", "ours", 10.0, 4)]
    assert [why for _, _, why in torch_better(faster)] == ["makespan 9 < 10"]
    lighter = [row("torch:X", "torch", 10.0, 3), row("ours", "ours", 10.0, 4)]
    assert len(torch_better(lighter)) == 1
    assert torch_better([row("torch:X", "torch", 10.0, 4), row("ours", "ours", 10.0, 4)]) == []


def test_stage_costs_halve_for_two_chunks() -> None:
    assert stage_costs("profiled", 2) == Costs(0.5, 0.55, 0.3, None, 0.05)


# ---- with torch: the real orders ---------------------------------------------------------------
torch_orders = pytest.importorskip(
    "torch.distributed.pipelining.schedules", reason="needs torch.distributed.pipelining"
)


@pytest.mark.parametrize("name", list(TORCH_SCHEDULES))
def test_every_torch_order_imports_and_validates(name: str) -> None:
    from megatron_pp_ext.analysis.torch_orders import import_torch_schedule

    imported = import_torch_schedule(name, 4, 8)
    schedule = imported.schedule
    validate(schedule)
    assert schedule.placement.style == TORCH_SCHEDULES[name].placement
    assert schedule.placement.num_stages == 4 * TORCH_SCHEDULES[name].stages_per_rank
    assert imported.repaired_ranks == ((3,) if name == "1F1B" else ())


@pytest.mark.parametrize(
    ("name", "p", "m", "bubble"),
    [
        ("1F1B", 4, 8, 3 / 11),  # (p-1)/(m+p-1)
        ("Interleaved1F1B", 4, 8, 3 / 19),  # (p-1)/(v m+p-1), v=2
        ("LoopedBFS", 4, 8, 3 / 19),
        ("ZBVZeroBubble", 4, 8, 0.0),
    ],
)
def test_known_bubbles(name: str, p: int, m: int, bubble: float) -> None:
    from megatron_pp_ext.analysis.torch_orders import import_torch_schedule

    schedule = import_torch_schedule(name, p, m).schedule
    result = simulate(schedule, stage_costs("unit", schedule.placement.num_stages // p))
    assert result.bubble_rate == pytest.approx(bubble, abs=1e-12)


def test_dualpipev_refuses_fewer_microbatches_than_stages() -> None:
    from megatron_pp_ext.analysis.torch_orders import import_torch_schedule

    with pytest.raises(ValueError, match="DualPipeV"):
        import_torch_schedule("DualPipeV", 4, 6)
