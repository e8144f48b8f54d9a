"""Per-stage costs from an uneven layer split (schedules/split_costs.py) and ``megatron-pp simulate``'s flags."""

from __future__ import annotations

import pytest

from megatron_pp_ext.cli.main import main
from megatron_pp_ext.schedules.costs import Costs
from megatron_pp_ext.schedules.layer_split import LayerSplit, LayerSplitError
from megatron_pp_ext.schedules.placement import bidirectional_placement, loop_placement, v_placement
from megatron_pp_ext.schedules.split_costs import stage_costs_from_layout, stage_weights

GIVEN = Costs(2.0, 3.0, 1.0, None, 0.5)


def test_an_even_split_keeps_the_given_costs() -> None:
    costs = stage_costs_from_layout(GIVEN, v_placement(2), 8)
    assert costs.t_f == (2.0,) * 4 and costs.t_b == (3.0,) * 4 and costs.t_w == (1.0,) * 4
    assert costs.t_comm == 0.5 and costs.t_bw is None


def test_costs_follow_each_model_stage_of_a_v_placement() -> None:
    # 7 layers, first stage 1: model stages [1, 2, 2, 2], mean 1.75; V stage s is model stage s
    costs = stage_costs_from_layout(GIVEN, v_placement(2), 7, LayerSplit(first=1))
    weights = [1, 2, 2, 2]
    assert costs.t_f == pytest.approx([2.0 * w / 1.75 for w in weights])
    assert costs.t_b == pytest.approx([3.0 * w / 1.75 for w in weights])
    assert sum(costs.t_f) == pytest.approx(2.0 * 4)  # the pipeline's total work is what the costs say


def test_both_replicas_of_a_bidirectional_placement_get_their_model_stage_costs() -> None:
    placement = bidirectional_placement(2)
    costs = stage_costs_from_layout(GIVEN, placement, 7, LayerSplit.from_layout("Et|ttt|t|ttL"))
    assert isinstance(costs.t_f, tuple)
    for stage in range(placement.num_stages):
        assert costs.t_f[stage] == pytest.approx(2.0 * [1, 3, 1, 2][placement.model_slice_of(stage)] / 1.75)


def test_the_embedding_and_loss_count_only_when_the_flags_say_so() -> None:
    split = LayerSplit(embedding=True, loss=True)
    assert stage_weights(6, 4, split) == [2.0, 2.0, 2.0, 2.0]  # [1, 2, 2, 1] layers + embedding + loss
    assert stage_weights(6, 4, split, embedding_weight=0.5, loss_weight=3.0) == [1.5, 2.0, 2.0, 4.0]
    loop = stage_costs_from_layout(GIVEN, loop_placement(2), 6, LayerSplit(first=2))  # [2, 4]
    assert loop.t_f == pytest.approx([2.0 * 2 / 3, 2.0 * 4 / 3])


def test_per_stage_costs_are_scaled_stage_by_stage() -> None:
    given = Costs((1.0, 2.0), 1.0, 1.0, None, 0.0)
    assert stage_costs_from_layout(given, loop_placement(2), 6, LayerSplit(first=2)).t_f == pytest.approx(
        [1.0 * 2 / 3, 2.0 * 4 / 3]
    )


def test_a_split_without_mapping_raises() -> None:
    with pytest.raises(LayerSplitError, match="--num-layers 7"):
        stage_costs_from_layout(GIVEN, v_placement(2), 5, LayerSplit(first=1))


def test_simulate_predicts_the_uneven_run(capsys: pytest.CaptureFixture[str]) -> None:
    def makespan(*flags: str) -> str:
        assert main(["simulate", "1f1b", "-p", "2", "-m", "4", "--costs", "1,1,1", *flags]) == 0
        return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("makespan"))

    even = makespan()
    # 1F1B at p = 2, m = 4 on stages of work [1, 3] / 2: the slow stage (F = 1.5, BW = 2 x 1.5) runs every
    # micro-batch back to back, after the fast stage's first F and before its last BW (F = 0.5, BW = 1)
    fast, slow = 0.5, 1.5
    expected = 4 * (slow + 2 * slow) + fast + 2 * fast
    assert float(makespan("--num-layers", "4", "--decoder-first-pipeline-num-layers", "1").split()[1]) == expected
    assert makespan("--num-layers", "4", "--pipeline-model-parallel-layout", "Ett|ttL") == even


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--decoder-first-pipeline-num-layers", "1"], ["needs --num-layers"]),
        (["--num-layers", "5", "--pipeline-model-parallel-layout", "Et|tL"], ["4 model stages", "v-half"]),
    ],
)
def test_simulate_refuses_a_split_in_one_line(capsys: pytest.CaptureFixture[str], flags, words) -> None:
    assert main(["simulate", "v-half", "-p", "2", "-m", "4", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(w in err for w in words), err


def test_interleaved_loop_placements_keep_megatrons_per_rank_meaning() -> None:
    with pytest.raises(LayerSplitError, match="megatron splits by pipeline rank"):
        stage_costs_from_layout(GIVEN, loop_placement(2, 2), 7, LayerSplit(first=1))
    assert stage_costs_from_layout(GIVEN, loop_placement(2, 2), 8).t_f == (2.0,) * 4  # even: no split to refuse
