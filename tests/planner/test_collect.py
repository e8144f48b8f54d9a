"""`megatron-pp collect`: Megatron log lines -> table, statuses, predictions, plot.

The fixtures in data/ follow megatron/training/training.py's ``training_log`` format (the
iteration line printed by the last rank), ``report_memory`` and ``report_theoretical_memory``
lines, and the ``(min, max) time across ranks`` timer block; plus an out-of-memory, a failed, a
timed-out, an unfinished run and one that aborted at exit after training.
"""

from __future__ import annotations

import csv
import io
import json
import shutil
from pathlib import Path

import pytest

from megatron_pp_ext.cli import main
from megatron_pp_ext.planner.collect import collect
from megatron_pp_ext.planner.collect_report import to_csv, to_markdown, write_outputs
from megatron_pp_ext.planner.log_parse import parse_log

DATA = Path(__file__).parent / "data"
OK = "zb-h1-t1p8d1-b3m32-v1-none"


def test_parse_a_successful_run() -> None:
    run = parse_log(DATA / f"{OK}.log")
    assert run.config_id == OK and run.status == "ok" and run.exit_code == 0
    assert [int(i["iteration"]) for i in run.iterations] == [1, 2, 3, 4, 5, 6]
    first = run.iterations[0]
    assert first["elapsed_ms"] == 4012.7 and first["tflops"] == 110.9 and first["global_batch"] == 96
    assert run.iterations[-1]["loss"] == pytest.approx(9.1)
    assert len(run.memory) == 8 and run.memory[7][1] == 24500 + 310 * 7  # max allocated, maxed over reports
    assert run.theoretical == (13442.11, 10110.92, 23553.03)
    assert run.timers["forward-backward"][1] == pytest.approx(2260.9)
    assert run.error is None


def test_statuses_and_error_lines() -> None:
    runs = {p.stem: parse_log(p) for p in DATA.glob("*.log")}
    assert runs["gpipe-t1p8d1-b3m32-v1-none"].status == "oom"
    assert "CUDA out of memory" in (runs["gpipe-t1p8d1-b3m32-v1-none"].error or "")
    failed = runs["interleaved-1f1b-t1p4d2-b3m16-v4-none"]
    assert failed.status == "failed" and (failed.error or "").startswith("RuntimeError: NCCL error")
    assert runs["1f1b-t1p8d1-b3m32-v1-none"].status == "timeout"
    assert runs["zb-h2-t1p8d1-b3m32-v1-none"].status == "incomplete"
    exited = runs["zb-h2-t1p8d1-b6m16-v1-none"]  # trained every iteration, aborted at exit
    assert exited.status == "exit-error" and exited.error == "terminate called without an active exception"


@pytest.mark.slow
def test_table_with_predictions(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    shutil.copytree(DATA, logs)
    ids = [p.stem for p in DATA.glob("*.log")]
    rows = [
        {"id": cid, "schedule": cid.split("-t1")[0], "tp": 1, "pp": 8, "dp": 1, "micro_batch": 3,
         "num_microbatches": 32, "chunks": 1, "recompute": "none", "iteration_time_s": 2.0,
         "tflops_per_gpu": 200.0, "peak_memory_gib": 30.0}
        for cid in [*ids, "v-half-t1p8d1-b3m32-v2-none"]
    ]  # fmt: skip
    (tmp_path / "plan.json").write_text(json.dumps({"format": "megatron-pp plan v1", "global_batch": 96,
                                                    "gpus": 8, "rows": rows, "grid": {}}))  # fmt: skip
    table, plan = collect(logs, skip=2)
    assert plan is not None
    by_id = {r["id"]: r for r in table}
    assert by_id["v-half-t1p8d1-b3m32-v2-none"]["status"] == "missing"
    ok = by_id[OK]
    assert ok["iteration_ms_median"] == pytest.approx(2300.35)  # iterations 3..6
    assert ok["samples_per_second"] == pytest.approx(96 / 2.30035, rel=1e-4)
    assert ok["tflops_per_gpu"] == pytest.approx(193.4)
    assert ok["max_allocated_mib"] == 24500 + 310 * 7
    assert ok["predicted_iteration_ms"] == 2000.0
    assert ok["measured_over_predicted_time"] == pytest.approx(1.15, abs=1e-3)
    text = to_markdown(table)
    assert "| zb-h1-t1p8d1-b3m32-v1-none | ok | 6 |" in text and "oom" in text and "missing" in text
    parsed = list(csv.DictReader(io.StringIO(to_csv(table))))
    assert {r["status"] for r in parsed} == {"ok", "exit-error", "oom", "failed", "timeout", "incomplete", "missing"}
    paths = write_outputs(table, tmp_path / "out")
    assert paths["csv"].exists() and paths["markdown"].exists()
    assert paths["plot"].stat().st_size > 1000  # matplotlib (Agg) wrote a PNG
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_collect_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    logs = tmp_path / "logs"
    shutil.copytree(DATA, logs)
    assert main(["collect", str(logs), "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "1 ok, 5 not ok" in out and (logs / "results.md").exists() and (logs / "results.csv").exists()
    assert main(["collect", str(tmp_path / "nowhere")]) == 2


def test_log_cut_mid_line_ignores_the_partial_line_and_is_not_ok(tmp_path: Path) -> None:
    text = (DATA / f"{OK}.log").read_text()
    last_iteration = max(i for i, line in enumerate(text.splitlines()) if "elapsed time per iteration" in line)
    lines = text.splitlines(keepends=True)
    head = "".join(lines[:last_iteration])
    marker = "elapsed time per iteration (ms): "
    cut = lines[last_iteration].index(marker) + len(marker) + 1
    path = tmp_path / f"{OK}.log"
    path.write_text(head + lines[last_iteration][:cut])  # "...(ms): 4" of "4012.7"
    run = parse_log(path)
    assert run.truncated and run.status == "incomplete"
    full = parse_log(DATA / f"{OK}.log")
    assert run.iterations == full.iterations[: len(run.iterations)]  # the partial line was not read
    assert len(run.iterations) == len(full.iterations) - 1


def test_log_without_end_of_training_line_is_not_ok(tmp_path: Path) -> None:
    text = (DATA / f"{OK}.log").read_text()
    assert "[after training is done]" in text
    path = tmp_path / f"{OK}.log"
    path.write_text("".join(line for line in text.splitlines(keepends=True) if "[after training is done]" not in line))
    assert parse_log(path).status == "incomplete"


def test_cpu_run_zeros_are_not_measurements(tmp_path: Path) -> None:
    """Megatron on CPU logs 0.0 TFLOP/s and 0 MB allocated (no CUDA allocator): the table says "-" for them,
    not 0 (launch-local's table once showed a throughput and memory of 0)."""
    text = (DATA / f"{OK}.log").read_text()
    text = text.replace("throughput per GPU (TFLOP/s/GPU): 110.9", "throughput per GPU (TFLOP/s/GPU): 0.0")
    import re

    text = re.sub(
        r"max allocated: [0-9.]+", "max allocated: 0.00", re.sub(r"max reserved: [0-9.]+", "max reserved: 0.00", text)
    )
    text = re.sub(r"\(TFLOP/s/GPU\): [0-9.]+", "(TFLOP/s/GPU): 0.0", text)
    (tmp_path / f"{OK}.log").write_text(text)
    rows, _ = collect(tmp_path)
    assert rows[0]["status"] == "ok" and rows[0]["samples_per_second"] != ""
    assert rows[0]["tflops_per_gpu"] == "" and rows[0]["max_allocated_mib"] == "" and rows[0]["max_reserved_mib"] == ""
    line = next(x for x in to_markdown(rows).splitlines() if x.startswith(f"| {OK}"))
    assert "| 0 |" not in line
