"""``megatron-pp bench --real-peers``: bad input refused before any rank, the report's arithmetic on given runs
(realized share, refusals named), and a small real run on two gloo ranks (losses, traces, torch on plain layers)."""

from __future__ import annotations

import pytest

from megatron_pp_ext.bench import real_peers_bench, real_peers_report
from megatron_pp_ext.cli import main
from megatron_pp_ext.verification.rank_pool import check_errors


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--real-peers", "-p", "9"], "-p with --real-peers: each size in 2..8, got '9'"),
        (["--real-peers", "-p", "2,x"], "-p with --real-peers: comma-separated sizes in 2..8"),
        (["--real-peers", "--peer-sizes", "huge"], "--peer-sizes: names from tiny, large, got 'huge'"),
        (["--real-peers", "--schedules", "zb-h1"], "--schedules with --real-peers: names from 1f1b, gpipe"),
        (["--real-peers", "--iterations", "2", "--warmup", "2"], "--iterations must be in 3..1000"),
        (["--real-peers", "--emulate"], "--real-peers: not with --emulate, -m, --m-factors, --costs or --plots"),
        (["--peer-sizes", "tiny"], "--peer-sizes: only with --real-peers"),
        (["--real-peers", "--write", "/nonexistent/dir/R.md"], "--write: no directory for '/nonexistent/dir/R.md'"),
    ],
)
def test_bad_input_is_one_line_before_any_rank(capsys, monkeypatch, flags, message) -> None:
    def no_ranks(*args, **kwargs):
        raise AssertionError("a rank pool was started")

    monkeypatch.setattr("megatron_pp_ext.verification.rank_pool.RankPool", no_ranks)
    assert main(["bench", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-pp: error: ") and message in err and err.count("\n") == 1, err


def _trace(op_ms: dict[str, dict[int, float]]) -> dict:
    host = {"ops": 8, "parts": {"bookkeeping": {"s": 0.0, "count": 8}}, "per_op_s": {"bookkeeping": 0.0}}
    return {"op_times_s": op_ms, "host": host, "model_forward_s": {}, "step_times_s": [0.1]}


def _case(name: str, ours_s: float, traces: list, refusal: str | None = None) -> dict:
    case = {"schedule": name, "peer": f"torch {name}", "p": 2, "size": "tiny", "ours_s": ours_s}
    case.update({"ours_losses": [1.0, 2.0], "traces": traces, "refusal": refusal})
    if refusal is None:
        case.update({"peer_s": ours_s, "ratio": 1.0, "peer_losses": [1.0, 2.0 * (1 + 1e-7)]})
    return case


def test_report_reads_the_realized_share_against_the_simulated_gain_and_names_a_refusal() -> None:
    fused = [_trace({"F": {0: 0.001}, "BW": {0: 0.002}}), _trace({"F": {1: 0.001}, "BW": {1: 0.002}})]
    split = [
        _trace({"F": {0: 0.001}, "B": {0: 0.001}, "W": {0: 0.001}}),
        _trace({"F": {1: 0.001}, "B": {1: 0.001}, "W": {1: 0.001}}),
    ]
    base = _case("1f1b", 0.010, fused)
    sim_1f1b = real_peers_report.simulated(base)
    assert sim_1f1b == pytest.approx(5 * 0.003)  # m = 4 on p = 2: (m + p - 1) (F + BW)
    gpipe = _case("gpipe", 0.010, fused, refusal="ValueError: no")
    settings = real_peers_bench.RealPeersSettings(
        (2,), ("tiny",), ("1f1b", "gpipe"), 3, 1, None, "megatron-pp bench ..."
    )
    text = real_peers_report.report(settings, [base, gpipe], {})
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if " | torch " in line}  # the peer table
    assert "torch gpipe: refused (ValueError: no)" in rows["| gpipe"]
    assert "| 1.0e-07 |" in rows["| 1f1b"]  # the peer's losses against ours
    base["ratio_quartiles"] = (0.99, 1.02)  # the middle half of the paired iterations beside the median
    text = real_peers_report.report(settings, [base, gpipe], {})
    assert "| 1.000 (0.990-1.020) |" in text
    # a split schedule: simulated gain from its own op times and those of the 1f1b traced beside it; measured gain
    # from the paired iterations of the same run; realized share = (measured - 1) / (simulated - 1)
    zb = _case("interleaved-zb", 0.008, split * 2)
    zb.update({"baseline_traces": fused, "baseline_s": 0.011, "measured_gain": 1.2})  # the 1f1b case: 1.25
    zb["traces"] = [
        _trace({"F": {0: 5e-4, 2: 5e-4}, "B": {0: 5e-4, 2: 5e-4}, "W": {0: 5e-4, 2: 5e-4}}),
        _trace({"F": {1: 5e-4, 3: 5e-4}, "B": {1: 5e-4, 3: 5e-4}, "W": {1: 5e-4, 3: 5e-4}}),
    ]
    sim_gain = sim_1f1b / real_peers_report.simulated(zb)
    assert real_peers_report.simulated(zb, baseline=True) == sim_1f1b
    text = real_peers_report.report(settings, [base, zb], {})
    row = next(line for line in text.splitlines() if line.startswith("| interleaved-zb"))
    cells = row.split(" | ")
    assert cells[-6] == "11.0"  # the 1f1b of the same run, not the 1f1b case's 10 ms
    assert cells[-4] == f"{sim_gain:.3f}" and cells[-3] == "1.200"
    assert cells[-1].rstrip(" |") == f"{(1.2 - 1) / (sim_gain - 1):.2f}"
    # the split in the pipelined runs: (B + W) / F per stage, ours from the traces, torch's from its op times
    zb["torch_op_times"] = [{"F": {0: 1.0, 2: 1.0}, "B": {0: 1.5, 2: 1.5}, "W": {0: 1.0, 2: 0.5}}]
    text = real_peers_report.report(settings, [base, zb], {})
    assert "| interleaved-zb | torch interleaved-zb | 2 | tiny | 2.00 | 2.25 |" in text


@pytest.mark.gloo
def test_a_small_real_run_gives_equal_losses_traces_and_torch_on_plain_layers(pool) -> None:
    from dataclasses import replace

    from megatron_pp_ext.bench import real_peers
    from megatron_pp_ext.bench.real_peers_cases import model_spec

    model = replace(model_spec("tiny"), num_layers=4)
    cases = {}
    for name in ("1f1b", "v-zb"):
        spec = real_peers.PeerRunSpec(name, 2, 4, model, iterations=2, trace_iterations=1)
        results = pool.run_fn(real_peers.run_on_rank, spec, 2, wall_timeout_s=900)
        check_errors(results)
        cases[name] = (spec, results)
    for name, (spec, results) in cases.items():
        assert all(r["refusal"] is None for r in results)
        ours = [x for r in results for it in r["losses"]["ours"] for x in it]
        theirs = [x for r in results for it in r["losses"]["torch"] for x in it]
        assert len(ours) == 2 * 4 and theirs == ours  # torch's loss_fn computes the loss as our runs do
        reference = [x for r in cases["1f1b"][1] for it in r["losses"]["ours"] for x in it]
        assert ours == reference  # the same forward math in every order of work
        baseline = [x for r in results for it in r["losses"].get("baseline", []) for x in it]
        assert baseline == ([] if name == "1f1b" else ours)  # our 1f1b runs beside every other schedule
        for r in results:
            if name == "1f1b":
                assert r["baseline_trace"] is None
            else:  # ... and is traced (the ops of its own placement)
                assert len(r["step_times"]["baseline"]) == spec.iterations
                assert r["baseline_trace"]["host"]["ops"] == len(
                    real_peers.generate_ours(cases["1f1b"][0]).ops[r["rank"]]
                )
        for r in results:
            trace = r["ours_trace"]
            assert trace["host"]["ops"] == len(real_peers.generate_ours(spec).ops[r["rank"]])
            assert {"p2p wait", "p2p posting", "bookkeeping"} <= set(trace["host"]["parts"])
            assert set(trace["model_forward_s"]) == set(trace["op_times_s"]["F"])  # per stage of this rank
            assert all(x > 0 for x in trace["model_forward_s"].values())
            kinds = set(r["torch_op_times_s"])
            assert kinds == ({"F", "B", "W"} if name == "v-zb" else {"F", "BW"}), kinds
            assert len(r["torch_plain_step_times"]) == (2 if name == "v-zb" else 0)


def test_paired_ratios_give_their_median_and_quartiles() -> None:
    assert real_peers_bench.paired([1.0, 2.0, 3.0, 4.0], [1.0] * 4) == (2.5, (1.75, 3.25))
    assert real_peers_bench.paired([2.0], [4.0]) == (0.5, (0.5, 0.5))
