"""MoE planning: the all-to-all cost model (hand-computed), the expert-parallel axis, the MoE presets and
``plan --moe-report``'s output."""

from __future__ import annotations

import re

import pytest

from megatron_pp_ext.cli.main import main
from megatron_pp_ext.planner.cost_model import CostModel, get_device
from megatron_pp_ext.planner.memory import TrainingSetup
from megatron_pp_ext.planner.models import get_model
from megatron_pp_ext.planner.moe_plan import MoeShape, a2a_seconds, ep_sizes, layer_split, moe_rows

MIXTRAL = get_model("mixtral-8x22b")
H100 = CostModel(MIXTRAL, get_device("H100-80GB"), TrainingSetup(distributed_optimizer=True))


def test_a2a_cost_by_hand() -> None:
    # H100 preset: NVLink 360 GB/s (10 us), network 40 GB/s (25 us), 8 GPUs per node.
    # Mixtral, sequence 4096, micro-batch 1, TP 2 with sequence parallelism: 2048 tokens per rank,
    # top-2, hidden 6144, bf16: V = 2048 * 2 * 6144 * 2 = 50,331,648 bytes.
    v = 2048 * 2 * 6144 * 2
    # EP 8 over TP 2: 16 consecutive ranks, 4 of the EP group per node: 3/8 of V on NVLink, 4/8 on the network
    expected = 25e-6 + max(v * 3 / 8 / 360e9, v * 4 / 8 / 40e9)
    assert a2a_seconds(MIXTRAL, H100, 1, 2, 8) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(6.5415e-4, rel=1e-3)
    # EP 4: the group fits in the node: 3/4 of V on NVLink
    assert a2a_seconds(MIXTRAL, H100, 1, 2, 4) == pytest.approx(10e-6 + v * 3 / 4 / 360e9, rel=1e-12)
    # EP 1: no all-to-all; micro-batch 2 doubles the volume
    assert a2a_seconds(MIXTRAL, H100, 1, 2, 1) == 0.0
    assert a2a_seconds(MIXTRAL, H100, 2, 2, 4) == pytest.approx(10e-6 + 2 * v * 3 / 4 / 360e9, rel=1e-12)


def test_ep_divides_dp_and_the_experts() -> None:
    assert ep_sizes(16, 8) == [1, 2, 4, 8]
    assert ep_sizes(12, 8) == [1, 2, 4]
    assert ep_sizes(6, 256) == [1, 2]
    assert ep_sizes(64, 128) == [1, 2, 4, 8, 16, 32, 64]


def test_layer_split_spreads_what_does_not_divide() -> None:
    assert layer_split(56, 8) == (7,) * 8
    assert sum(layer_split(61, 16)) == 61
    assert layer_split(61, 16)[0] == 3 and max(layer_split(61, 16)) == 4
    with pytest.raises(ValueError, match="cannot fill"):
        layer_split(3, 8)


def test_presets() -> None:
    v3, qwen = get_model("deepseek-v3"), get_model("qwen3-235b-a22b")
    assert v3.layer_kinds()[:4] == ("dense", "dense", "dense", "moe") and len(v3.layer_kinds()) == 61
    assert (v3.num_experts, v3.moe_router_topk, v3.moe_shared_expert_ffn, v3.hidden_size) == (256, 8, 2048, 7168)
    assert "--mtp-num-layers" in v3.megatron_args()
    assert 650e9 < v3.num_parameters() < 720e9  # 671B published (MLA costed as plain attention)
    assert 230e9 < qwen.num_parameters() < 240e9
    assert 138e9 < MIXTRAL.num_parameters() < 143e9
    assert (MIXTRAL.num_layers, MIXTRAL.num_experts, MIXTRAL.moe_router_topk) == (56, 8, 2)


def test_ep_sizes_that_do_not_divide_or_fit_are_dropped() -> None:
    qwen = get_model("qwen3-235b-a22b")
    cost = CostModel(qwen, get_device("H100-80GB"), TrainingSetup(distributed_optimizer=True))
    shape = MoeShape(gpus=128, pp=8, tp=2, micro_batch=1, global_batch=64)
    rows, skipped, dropped = moe_rows(qwen, cost, shape, ["1f1b"], eps=[1, 3, 8], budget_bytes=78 * 2**30)
    assert set(dropped) == {1, 3}
    assert "divide DP = 8" in dropped[3]
    assert "GiB per rank" in dropped[1]
    assert [r.ep for r in rows] == [8] and not skipped
    with pytest.raises(ValueError, match="--global-batch"):
        moe_rows(qwen, cost, MoeShape(128, 8, 2, 1, 60), ["1f1b"])


def test_plan_moe_report(capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "plan", "--model", "mixtral-8x22b", "--moe-report", "--gpus", "64", "--global-batch", "128",
        "--pp", "4", "--tp", "2", "--device", "H100-80GB", "--distributed-optimizer",
        "--schedules", "1f1b,dualpipev", "--ep", "1,2,8",
    ]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("mixtral-8x22b: 64 GPUs, PP 4 x TP 2 x DP 8, micro-batch 1, 16 micro-batches")
    rows = re.findall(r"^(1f1b|dualpipev)\s+\d+\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+(\S+)", out, re.MULTILINE)
    assert {(name, int(ep)) for name, ep, *_ in rows} == {("1f1b", 2), ("1f1b", 8), ("dualpipev", 2), ("dualpipev", 8)}
    table = {(name, int(ep)): (float(off), None if on == "-" else float(on)) for name, ep, _, off, on in rows}
    assert re.search(r"^EP 1 dropped: parameters and optimizer state need [\d.]+ GiB per rank$", out, re.MULTILINE)
    assert table[("1f1b", 8)][1] is not None  # 1f1b gets the executor's pairs (schedules/pairs.py)
    off8, on8 = table[("dualpipev", 8)]
    assert on8 is not None and on8 < off8  # inter-node all-to-alls: the overlap hides them
    best = min(min(off, on or off) for off, on in table.values())
    winner = re.search(r"^winner: (\S+) (with|without) overlap, ([\d.]+)% faster", out, re.MULTILINE)
    assert winner is not None
    name, how = winner.group(1), winner.group(2)
    assert min(v for (n, _), pair in table.items() if n == name for v in pair if v is not None) == best
    assert (how == "with") == any(on == best for _, on in table.values())
    assert re.search(r"^EP 8: best without overlap \S+ [\d.]+ s; best with overlap dualpipev", out, re.MULTILINE)


def test_plan_moe_report_refusals(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "zb-1.5b", "--moe-report", "--pp", "2"]) != 0
    assert "no experts" in capsys.readouterr().err
    assert main(["plan", "--model", "mixtral-8x22b", "--ep", "2"]) != 0
    assert "--ep: only with --moe-report" in capsys.readouterr().err
