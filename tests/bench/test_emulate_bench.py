"""``megatron-pp bench --emulate``: its plumbing, checked deterministically (no timed threshold).

The padding (every op of ours and of megatron-core's own schedules lasts at least its pad, every one of
them is padded), the accounting of the time between ops, the table's rows, the results-file block and the
refusal of bad input before any rank starts.
"""

from __future__ import annotations

import importlib.util
import itertools
import time
from pathlib import Path

import pytest

from megatron_pp_ext.bench import emulate_bench, emulate_report, emulate_results
from megatron_pp_ext.bench.emulate import PaddedTracer
from megatron_pp_ext.bench.results_file import block_markers
from megatron_pp_ext.cli import main
from megatron_pp_ext.schedules import generate
from megatron_pp_ext.schedules.ir import Op, OpKind


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--emulate", "-p", "9"], "-p with --emulate must be in 2..8, got 9"),
        (["--emulate", "-p", "2,4"], "-p with --emulate must be one size in 2..8"),
        (["--emulate", "-m", "65"], "-m must be in 1..64, got 65"),
        (["--emulate", "--schedules", "1f1b,nope"], "--schedules: unknown ['nope']; registered: 1f1b,"),
        (["--emulate", "--costs", "20,20"], "costs must be 3 or 4 comma-separated numbers F,B,W[,COMM]"),
        (["--emulate", "--costs", "20,20,-1"], "costs F,B,W[,COMM] must be finite numbers in [0, "),
        (["--emulate", "--costs", "20,20,2000"], "--costs F,B,W[,COMM] with --emulate are ms, each in [0, 1000]"),
        (["--emulate", "--m-factors", "2"], "--m-factors: not with --emulate (give -m)"),
        (["--emulate", "--iterations", "1001"], "--iterations must be in 1..1000"),
        (["-m", "4", "--costs", "1,1,1"], "-m, --costs: only with --emulate"),
    ],
)
def test_bad_input_is_one_line_before_any_rank(capsys, monkeypatch, flags, message) -> None:
    def no_ranks(*args, **kwargs):
        raise AssertionError("a rank pool was started")

    monkeypatch.setattr("megatron_pp_ext.verification.rank_pool.RankPool", no_ranks)
    assert main(["bench", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("megatron-pp: error: ") and message in err and err.count("\n") == 1, err


def test_a_failed_rank_is_one_error_and_exit_status_1(capsys, monkeypatch) -> None:
    from megatron_pp_ext.verification.rank_pool import VerifyRunError

    def fails(settings, pool=None, say=print):
        raise VerifyRunError("rank 1: PipelineCommError: recv timed out")

    monkeypatch.setattr(emulate_bench, "run_emulation", fails)
    assert main(["bench", "--emulate", "-p", "2", "-m", "4"]) == 1
    err = capsys.readouterr().err
    assert err == "megatron-pp: error: bench --emulate: rank 1: PipelineCommError: recv timed out\n"


def test_padded_tracer_pads_every_op_and_accounts_for_the_gaps() -> None:
    pads = {"F": (0.004, 0.004), "B": (0.003, 0.003), "W": (0.002, 0.002), "BW": (0.005, 0.005)}
    tracer = PaddedTracer(0, pads)
    ops = [Op(OpKind.F, 0, 0), Op(OpKind.B, 0, 0), Op(OpKind.W, 0, 0), Op(OpKind.BW, 1, 0)]
    tracer.begin_iteration()
    for op in ops:
        time.sleep(0.003)  # waiting for the op's input
        if op.kind == OpKind.BW:  # the executor reports its protocol's events: a receive wait that blocked 3 ms
            tracer.protocol("recv-wait", "act", waited_s=0.003)
        tracer.begin_op(op)
        tracer.end_op(op)  # no real compute: the op lasts its pad
        tracer.begin_comm()
        time.sleep(0.001)
        tracer.end_comm()
    tracer.end_iteration()
    (breakdown,) = tracer.breakdowns
    assert [name for _, name, *_ in tracer.ops] == [str(op) for op in ops]
    for _, _, kind, real, pad, lasted, _ in tracer.ops:
        assert lasted >= pad == pads[kind][0] and lasted >= real
    starts = [started for *_, started in tracer.ops]
    assert starts == sorted(starts) and all(b - a >= 0.003 for a, b in itertools.pairwise(starts))
    assert breakdown["compute"] >= sum(pad for *_, pad, _, _ in tracer.ops)
    waits = breakdown["wait"]
    assert set(waits) == {"F", "B", "W", "BW"} and all(waits[k] >= 0.003 for k in "FBW")
    assert breakdown["recv_wait"] >= 0.003 and breakdown["send_wait"] == 0.0
    assert breakdown["post"] >= 4 * 0.001
    parts = breakdown["compute"] + sum(waits.values()) + breakdown["post"] + breakdown["between"]
    parts += breakdown["recv_wait"] + breakdown["send_wait"]
    assert parts + breakdown["drain"] == pytest.approx(breakdown["span"], abs=1e-9)  # every moment counted once
    assert len(tracer.iterations) == 1  # the base tracer's record too


def _outcome(rows: list[emulate_results.Row], settings: emulate_results.Settings) -> emulate_results.Outcome:
    return emulate_results.Outcome(settings, 0.2, 0.1, rows, {"gpipe": "refused"}, (0.5, 0.6), 1.0)


def _settings(p: int = 2, m: int = 4) -> emulate_results.Settings:
    return emulate_results.Settings(p, m, ("1f1b",), 2, 1, 2.0, 2.0, 1.0, None, command=f"cmd p={p} m={m}")


def test_results_block_is_replaced_not_appended(tmp_path: Path) -> None:
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\nkept\n\n## Later section\n")
    for p, m, text in ((2, 4, "first"), (2, 8, "other"), (2, 4, "second")):
        emulate_report.write_block(str(results), _settings(p, m), text)
    out = results.read_text()
    assert out.startswith("# Results\n\nkept\n\n## Later section\n")
    begin, end = block_markers(emulate_results.BLOCK)
    assert out.count(begin) == 1 and out.count(f"## {emulate_results.SECTION}") == 1
    assert "first" not in out and out.index("### p = 2, m = 4\n\nsecond") < out.index("### p = 2, m = 8\n\nother")
    assert out.rstrip().endswith(end)


@pytest.mark.gloo
def test_emulated_run_pads_every_op_and_reports_every_schedule(pool, tmp_path: Path) -> None:
    """p=2, m=4, tiny pads: every op of ours and of megatron's lasted at least its pad, every op was padded
    (counted against the schedule), one table row per schedule, one breakdown row per schedule and rank."""
    settings = emulate_results.Settings(
        p=2,
        m=4,
        schedules=("1f1b", "zb-h1", "interleaved-1f1b"),
        iterations=2,
        warmup=1,
        t_f=4.0,
        t_b=4.0,
        t_w=3.0,
        comm_ms=None,
        command="test",
    )
    outcome = emulate_bench.run_emulation(settings, pool, say=lambda text: None)
    assert [r.name for r in outcome.rows] == ["1f1b", "zb-h1", "interleaved-1f1b"]
    assert outcome.comm_ms > 0 and outcome.comm_fastest_ms is not None
    assert outcome.paid_hop_ms is not None and outcome.paid_hop_ms[0] > 0 and outcome.paid_hop_ms[1] > 0
    for row in outcome.rows:
        schedule = generate(row.name, 2, 4)
        assert row.ops == settings.iterations * sum(len(ops) for ops in schedule.ops)  # every op traced and padded
        assert row.short_ops == 0
        assert row.simulated > 0 and row.measured > 0
        # re-simulated with the hop the 1f1b run paid (its consumers waited for its messages: some were timed)
        assert row.simulated_paid_hop > 0 and row.ratio_paid_hop > 0
        assert [b["rank"] for b in row.ranks] == [0, 1]
        for b in row.ranks:
            assert b["compute"] >= b["real_compute"] >= 0 and b["idle"] >= 0
        if row.name in ("1f1b", "interleaved-1f1b"):  # megatron's own: a forward and a backward per micro-batch
            assert row.native == row.name and row.native_measured > 0 and row.ours_vs_native > 0
            v = schedule.chunks_per_rank
            assert row.native_ops == settings.iterations * 2 * (2 * 4 * v) and row.native_short_ops == 0
        else:
            assert row.native is None and row.native_ops == 0
    assert outcome.rows[0].sim_gain == 1.0 and outcome.rows[0].measured_gain == 1.0
    text = emulate_report.report(outcome)
    names = [r.name for r in outcome.rows]
    assert _first_cells(text, "| schedule | v | simulated ms") == names
    assert _first_cells(text, "| ours | megatron ms") == ["1f1b", "interleaved-1f1b"]
    assert _first_cells(text, "| schedule | rank |") == [name for name in names for _ in range(2)]
    assert "WARNING" not in text or "exceeded their pad" in text  # a loaded machine may warn; never broken pads
    assert "ended before their pad" not in text
    if importlib.util.find_spec("matplotlib") is not None:
        assert emulate_report.draw(outcome, str(tmp_path)).stat().st_size > 0


def _first_cells(text: str, header: str) -> list[str]:
    """The first cell of each row of the markdown table whose header starts with ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header)) + 2
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    return [line.split("|")[1].strip() for line in lines[start:end]]


@pytest.mark.parametrize("name", ["1f1b", "interleaved-1f1b", "v-zb"])
def test_paid_hop_is_read_off_the_ops_where_a_consumer_waited(name: str) -> None:
    """A simulated timeline with hop time 0.7 ms, turned into the ranks' traced ops (seconds): the hop the
    run paid is 0.7 ms, from the messages whose consumer waited (the others would read shorter)."""
    from megatron_pp_ext.analysis.simulate import simulate
    from megatron_pp_ext.schedules.costs import Costs

    schedule = generate(name, 2, 4)
    timeline = simulate(schedule, Costs(20.0, 20.0, 15.0, None, 0.7)).timeline
    results = [
        {"pp_rank": rank, "ops": [(1, op, "F", 0.0, 0.0, (end - start) / 1000, start / 1000)]}
        for rank, op, start, end in timeline
    ]
    merged = [{"pp_rank": r, "ops": [op for x in results if x["pp_rank"] == r for op in x["ops"]]} for r in (0, 1)]
    hop, count = emulate_bench.paid_hop_ms(schedule, merged, warmup=1)
    assert hop == pytest.approx(0.7) and count > 0
    assert emulate_bench.paid_hop_ms(schedule, merged, warmup=2) is None  # only timed iterations count
