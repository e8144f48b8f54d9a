"""The `megatron-pp` command line, run in-process through main([...])."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_pp_ext.cli import main
from megatron_pp_ext.schedule_args import parse_cli_memory_limit
from megatron_pp_ext.schedules import generate, names

JSON_KEYS = {
    "schedule",
    "p",
    "m",
    "v",
    "makespan",
    "bubble_rate",
    "sync_bubble_rate",
    "bubble_rate_per_rank",
    "peak_activations",
    "peak_activations_1f1b_units",
    "p2p_messages",
}


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_list(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "list")
    assert code == 0
    header = out.splitlines()[0].split()
    assert header == ["name", "placement", "B/W", "split"]  # description and constraints below each name
    for name in names():
        assert any(line.startswith(name + " ") for line in out.splitlines()), name
    assert "microbatch_group_size" in out


def test_simulate_summary(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "simulate", "1f1b", "-p", "4", "-m", "8")
    assert code == 0 and err == ""
    assert "bubble rate     0.2727" in out  # (p-1)/(m+p-1) = 3/11
    assert "p2p messages" in out and "rank" in out
    assert "F0.0" not in out


def test_simulate_show(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "simulate", "gpipe", "-p", "2", "-m", "2", "--show")
    assert code == 0
    assert "rank  0: F0.0  F0.1  BW0.0 BW0.1" in out


def test_simulate_json_contract(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "simulate", "1f1b", "-p", "4", "-m", "8", "--json", "--costs", "1,1,1,0")
    assert code == 0
    data = json.loads(out)
    assert JSON_KEYS <= set(data)
    assert (data["schedule"], data["p"], data["m"]) == ("1f1b", 4, 8)
    assert data["bubble_rate"] == pytest.approx(3 / 11)
    assert len(data["bubble_rate_per_rank"]) == len(data["peak_activations"]) == 4
    assert data["peak_activations"] == [4, 3, 2, 1]
    assert data["p2p_messages"] == 2 * 3 * 8
    assert "timeline" not in data


def test_simulate_costs_change_the_result(capsys: pytest.CaptureFixture[str]) -> None:
    _, unit, _ = run(capsys, "simulate", "1f1b", "-p", "4", "-m", "8", "--json")
    _, comm, _ = run(capsys, "simulate", "1f1b", "-p", "4", "-m", "8", "--json", "--costs", "1,2,1,0.5")
    assert json.loads(comm)["makespan"] > json.loads(unit)["makespan"]


def test_simulate_schedule_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "s.csv"
    generate("1f1b", 3, 5).save(path)
    code, out, _ = run(capsys, "simulate", "--schedule-file", str(path), "--json")
    assert code == 0
    assert json.loads(out)["bubble_rate"] == pytest.approx(2 / 7)
    code, _, err = run(capsys, "simulate", "--schedule-file", str(path), "-p", "4")
    assert code == 2 and "-p 4 disagrees" in err


def test_unknown_schedule_lists_valid_names(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "simulate", "2f2b", "-p", "4", "-m", "8")
    assert code == 2 and out == ""
    assert err.startswith("megatron-pp: error: unknown pipeline schedule '2f2b'")
    assert all(name in err for name in names())
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["simulate", "1f1b", "-p", "4", "-m", "8", "-v", "2"], "v must be 1"),
        (["simulate", "1f1b", "-p", "4", "-m", "8", "--memory-limit", "2p"], "memory_limit=8"),
        (["simulate", "1f1b", "-p", "4", "-m", "8", "--memory-limit", "lots"], "--memory-limit"),
        (["simulate", "1f1b", "-p", "4", "-m", "8", "--costs", "1,x"], ""),
        (["simulate", "interleaved-1f1b", "-p", "4", "-m", "6"], "microbatch_group_size"),
        (["simulate", "1f1b", "-p", "4"], "needs -p (ranks) and -m"),
        (["simulate"], "give a schedule name"),
        (["draw", "1f1b", "-p", "2", "-m", "2", "-o", "out.pdf"], ".png or .svg"),
    ],
)
def test_bad_input_exits_2(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert err.startswith("megatron-pp: error: ") and message in err
    assert "Traceback" not in err


def test_argparse_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["simulate", "1f1b", "-p", "zero", "-m", "8"])
    assert exc.value.code == 2
    assert "megatron-pp" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "p", "value"), [("12", 4, 12), ("2p", 4, 8), ("1.5p", 4, 6), ("2.5", 4, 2.5)])
def test_parse_memory_limit(text: str, p: int, value: float) -> None:
    assert parse_cli_memory_limit(text, p) == value
    assert parse_cli_memory_limit(None, p) is None


def test_compare(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "compare", "-p", "4", "-m", "8")
    assert code == 0
    for name in ("gpipe", "1f1b"):
        assert any(line.startswith(name + " ") for line in out.splitlines()), name
    assert "peak act (1F1B)" in out


def test_compare_lists_inapplicable_with_reason(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "compare", "-p", "4", "-m", "8", "-v", "3")
    assert code == 0
    assert "not applicable:" in out
    assert "1f1b: 1f1b runs one chunk per rank: v must be 1" in out


def test_compare_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "compare", "-p", "4", "-m", "6", "--json")
    assert code == 0
    data = json.loads(out)
    by_name = {row["schedule"]: row for row in data["schedules"]}
    assert {"gpipe", "1f1b"} <= set(by_name)
    assert all(JSON_KEYS <= set(row) for row in data["schedules"])
    assert "interleaved-1f1b" in data["inapplicable"]  # m=6 is not a multiple of p=4
    assert set(by_name) | set(data["inapplicable"]) | set(data["invalid"]) == set(names())


def test_validate_good_csv(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "good.csv"
    generate("1f1b", 4, 8).save(path)
    code, out, _ = run(capsys, "validate", str(path))
    assert code == 0
    assert out.startswith(f"OK {path}: 1f1b") and "p=4 m=8" in out


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0,F0.0,BW0.0\n1,F1.0\n", "BW1.0"),  # missing backward
        ("0,BW0.0,F0.0\n1,F1.0,BW1.0\n", "BW0.0"),  # backward before its forward
        ("0,F0.0,Q\n", "cannot parse op 'Q'"),
    ],
)
def test_validate_bad_csv(capsys: pytest.CaptureFixture[str], tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    code, out, err = run(capsys, "validate", str(path))
    assert code == 1 and out == ""
    assert err.startswith(f"INVALID {path}:") and message in err
    assert "Traceback" not in err


def test_validate_missing_file(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, "validate", str(tmp_path / "nope.csv"))
    assert code == 1 and "cannot read schedule file" in err


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_draw(capsys: pytest.CaptureFixture[str], tmp_path: Path, suffix: str) -> None:
    path = tmp_path / f"gantt{suffix}"
    code, out, _ = run(capsys, "draw", "1f1b", "-p", "4", "-m", "8", "--costs", "1,2,0,0", "-o", str(path))
    assert code == 0 and str(path) in out
    assert path.exists() and path.stat().st_size > 1000


def test_verify_without_runtime(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "megatron_pp_ext.cli.verify_command", None)  # import fails
    code, _, err = run(capsys, "verify", "1f1b", "-p", "2")
    assert code == 2
    assert "verify needs the megatron_pp_ext runtime" in err


def test_non_runtime_commands_do_not_import_torch(tmp_path: Path) -> None:
    csv = tmp_path / "s.csv"
    generate("1f1b", 2, 2).save(csv)
    script = (
        "import sys\n"
        "from megatron_pp_ext.cli import main\n"
        "for argv in (['list'], ['simulate', '1f1b', '-p', '2', '-m', '2', '--json'], "
        "['compare', '-p', '2', '-m', '4'], ['validate', sys.argv[1]]):\n"
        "    assert main(argv) == 0, argv\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'matplotlib'))\n"
        "assert not bad, bad[:5]\n"
    )
    proc = subprocess.run([sys.executable, "-c", script, str(csv)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


# ---- data parallelism (simulate --dp, validate --collectives/--fsdp) ----------------------------------
DP_ARGS = ["--dp", "4", "--dp-bandwidth", "50", "--param-bytes", "300M"]


def test_simulate_dp_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "simulate", "bfs", "-p", "4", "-m", "8", "-v", "2", *DP_ARGS, "--fsdp", "--json")
    assert code == 0 and err == ""
    data = json.loads(out)["data_parallel"]
    assert data["dp"] == 4 and data["reduce"] == "reduce-scatter"
    assert len(data["exposed"]) == 4 and data["gathers"] == [3, 3, 3, 3]  # 2v - 1 with FSDP, limit 1
    reductions = {(r["rank"], r["stage"]): (r["start"], r["end"]) for r in data["reductions"]}
    assert set(reductions) == {(s % 4, s) for s in range(8)}  # every chunk of every rank, once
    # 300 MB per rank, 150 MB per chunk, (N-1)/N x 150e6 B / 50e9 B/s = 2.25 ms per reduce-scatter
    assert all(end - start == pytest.approx(2.25) for start, end in reductions.values())
    assert data["iteration_time"] == json.loads(out)["makespan"] >= max(data["compute_end"])


def test_simulate_dp_report(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "simulate", "interleaved-1f1b", "-p", "4", "-m", "8", "-v", "2", *DP_ARGS)
    assert code == 0
    assert "data parallel   dp=4, all-reduce per chunk" in out
    assert "exposed dp" in out and "gradient reductions (rank, chunk, stage, start, end):" in out
    _, plain, _ = run(capsys, "simulate", "interleaved-1f1b", "-p", "4", "-m", "8", "-v", "2")
    assert "data parallel" not in plain and "exposed dp" not in plain
    _, plain_json, _ = run(capsys, "simulate", "bfs", "-p", "4", "-m", "8", "--json")
    assert "data_parallel" not in json.loads(plain_json)


def test_simulate_microbatch_group_size(capsys: pytest.CaptureFixture[str]) -> None:
    _, pure, _ = run(capsys, "simulate", "bfs", "-p", "4", "-m", "8", "--json")
    _, hybrid, _ = run(capsys, "simulate", "bfs", "-p", "4", "-m", "8", "--microbatch-group-size", "4", "--json")
    assert json.loads(pure)["peak_activations"] == [16] * 4 and json.loads(hybrid)["peak_activations"] == [8] * 4


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--dp", "1", "--dp-bandwidth", "5", "--param-bytes", "1M"], "--dp must be an integer >= 2"),
        (["--dp", "4"], "--dp 4 needs --dp-bandwidth and --param-bytes"),
        (["--dp", "4", "--dp-bandwidth", "fast", "--param-bytes", "1M"], "--dp-bandwidth must be a number of GB/s"),
        (["--dp", "4", "--dp-bandwidth", "-1", "--param-bytes", "1M"], "--dp-bandwidth must be a number of GB/s"),
        (["--dp", "4", "--dp-bandwidth", "5", "--param-bytes", "lots"], "--param-bytes must be a number of bytes"),
        (["--fsdp"], "--fsdp describes data parallelism: give --dp N"),
        ([*DP_ARGS, "--fsdp-max-unsharded", "2"], "--fsdp-max-unsharded needs --fsdp"),
        ([*DP_ARGS, "--fsdp", "--fsdp-max-unsharded", "0"], "--fsdp-max-unsharded must be >= 1"),
        (["--microbatch-group-size", "9"], "microbatch_group_size (micro-batches per breadth-first group) must be"),
    ],
)
def test_simulate_dp_bad_input(capsys: pytest.CaptureFixture[str], extra: list[str], message: str) -> None:
    code, out, err = run(capsys, "simulate", "bfs", "-p", "4", "-m", "8", *extra)
    assert code == 2 and out == ""
    assert err.startswith("megatron-pp: error: ") and message in err and err.count("\n") == 1


def test_validate_collectives(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = tmp_path / "bfs.csv"
    generate("bfs", 4, 8, v=2).save(path)
    code, out, _ = run(capsys, "validate", str(path))
    assert code == 0 and "collectives checked" not in out and out.rstrip().endswith("deadlock-free")  # unchanged
    code, out, _ = run(capsys, "validate", str(path), "--fsdp")
    assert code == 0 and "collectives checked (8 reduce-grads, 12 unshard, 12 reshard)" in out
    code, out, _ = run(capsys, "validate", str(path), "--distributed-optimizer")
    assert code == 0 and "8 reduce-grads, 8 param-sync" in out


def test_validate_reports_broken_collectives(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib
    from dataclasses import replace

    from megatron_pp_ext.schedules.collectives import derive_collectives

    validate_module = importlib.import_module("megatron_pp_ext.analysis.schedule_check")

    def drops_last_reduction(schedule, policy=None):  # type: ignore[no-untyped-def]
        plan = derive_collectives(schedule, policy)
        return replace(plan, at=(plan.at[0][:-1], *plan.at[1:]))

    monkeypatch.setattr(validate_module, "derive_collectives", drops_last_reduction)
    path = tmp_path / "bfs.csv"
    generate("bfs", 2, 4, v=2).save(path)
    code, out, err = run(capsys, "validate", str(path), "--collectives")
    assert code == 1 and out == ""
    assert err.startswith(f"INVALID {path}: rank 0: chunks [0] never reduce their gradients")


def test_bench_writes_the_peers_section_and_replaces_it(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed.pipelining.schedules", reason="bench imports torch's schedules")
    results = tmp_path / "RESULTS.md"
    results.write_text("# Results\n\nkept\n")
    for _ in range(2):  # the second run replaces the section instead of appending another
        code, out, _err = run(capsys, "bench", "-p", "4", "--m-factors", "2", "--write", str(results))
        assert code == 0 and "wrote the peers section" in out
    text = results.read_text()
    assert text.startswith("# Results\n\nkept\n") and text.count("<!-- peers:begin -->") == 1
    assert "| 4 | 8 | 1F1B | **torch:1F1B** |" in text and "repaired F numbering on rank(s) [3]" in text
    assert "| 4 | 8 | InterleavedZeroBubble | interleaved-zb | 25.500 |" in text  # our counterpart of torch's ZB1P
    better = text.split("### Where torch's order is better")[1].split("###")[0]
    assert "InterleavedZeroBubble" not in better  # interleaved-zb ties ZB1P at its memory


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--clip-grad", "1"], "go with --post-validation"),
        (["--post-validation-late"], "go with --post-validation"),
        (["--post-validation", "--inject-inf", "3:0"], "--inject-inf 3:0: ITER must be < --iterations (3)"),
        (["--post-validation", "--inject-inf", "0:2"], "STAGE < 2"),
        (["--post-validation", "--no-ddp"], "--post-validation wraps megatron's optimizer"),
    ],
)
def test_verify_post_validation_refuses_bad_input(capsys: pytest.CaptureFixture[str], flags, message) -> None:
    """Refused with one line before any rank is spawned."""
    assert main(["verify", "zb-h1", "-p", "2", "-m", "4", *flags]) == 2
    assert message in capsys.readouterr().err
