"""``megatron-pp collect``'s outputs: ``results.csv``, ``results.md`` (and ``throughput.png``, drawn by
:mod:`.collect_plot`) from the rows :func:`.collect.collect` returns."""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .collect_plot import plot_throughput  # imports matplotlib only when it draws

__all__ = ["COLUMNS", "MD_COLUMNS", "to_csv", "to_markdown", "write_outputs"]

COLUMNS = (
    "id",
    "schedule",
    "tp",
    "pp",
    "dp",
    "micro_batch",
    "num_microbatches",
    "chunks",
    "recompute",
    "status",
    "iterations",
    "train_iters",
    "iteration_ms_median",
    "iteration_ms_mean",
    "samples_per_second",
    "tflops_per_gpu",
    "loss_last",
    "max_allocated_mib",
    "max_reserved_mib",
    "theoretical_total_mib",
    "predicted_iteration_ms",
    "predicted_tflops_per_gpu",
    "predicted_peak_memory_gib",
    "measured_over_predicted_time",
    "error",
    "log",
)


MD_COLUMNS = (
    ("config", "id"),
    ("status", "status"),
    ("iters", "iterations"),
    ("iter ms", "iteration_ms_median"),
    ("samples/s", "samples_per_second"),
    ("TFLOP/s/GPU", "tflops_per_gpu"),
    ("loss", "loss_last"),
    ("max alloc MiB", "max_allocated_mib"),
    ("predicted iter ms", "predicted_iteration_ms"),
    ("measured/predicted", "measured_over_predicted_time"),
    ("predicted peak GiB", "predicted_peak_memory_gib"),
)


def to_csv(rows: Sequence[Mapping[str, Any]]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(COLUMNS), extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: row.get(k, "") for k in COLUMNS})
    return out.getvalue()


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value) if value not in (None, "") else "-"


def to_markdown(rows: Sequence[Mapping[str, Any]]) -> str:
    header = [h for h, _ in MD_COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        cells = [_fmt(row.get(key, "")) for _, key in MD_COLUMNS]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    failed = [r for r in rows if r.get("status") not in ("ok",)]
    for r in failed:
        if r.get("error"):
            lines.append(f"\n* `{r['id']}` {r['status']}: {r['error']}")
    return "\n".join(lines)


def write_outputs(rows: Sequence[Mapping[str, Any]], out_dir: str | Path, plot: bool = True) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out / "results.csv", "markdown": out / "results.md"}
    paths["csv"].write_text(to_csv(rows))
    paths["markdown"].write_text(to_markdown(rows) + "\n")
    if plot:
        png = plot_throughput(rows, out / "throughput.png")
        if png is not None:
            paths["plot"] = png
    return paths
