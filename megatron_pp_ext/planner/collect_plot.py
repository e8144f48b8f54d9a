"""``megatron-pp collect``'s ``throughput.png``: measured throughput per configuration next to the plan's
prediction (matplotlib, imported when drawing)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .log_parse import MEASURED

__all__ = ["plot_throughput"]


def plot_throughput(rows: Sequence[Mapping[str, Any]], path: str | Path) -> Path | None:
    """Bar chart of measured throughput per configuration, grouped (coloured) by schedule, with
    the plan's prediction as a marker. Uses TFLOP/s per GPU when Megatron printed non-zero values,
    else samples/s. Returns ``None`` when nothing ran."""
    ok = [r for r in rows if r.get("status") in MEASURED and r.get("iteration_ms_median") not in ("", None)]
    if not ok:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    use_tflops = all(isinstance(r.get("tflops_per_gpu"), float) and r["tflops_per_gpu"] > 0 for r in ok)
    key, label = ("tflops_per_gpu", "TFLOP/s per GPU") if use_tflops else ("samples_per_second", "samples/s")
    ok.sort(key=lambda r: (str(r.get("schedule")), -float(r.get(key) or 0)))
    schedules = sorted({str(r.get("schedule")) for r in ok})
    cmap = plt.get_cmap("tab10")
    colors = {s: cmap(i % 10) for i, s in enumerate(schedules)}
    fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(ok) + 2), 4.5))
    xs = list(range(len(ok)))
    ax.bar(xs, [float(r.get(key) or 0) for r in ok], color=[colors[str(r.get("schedule"))] for r in ok])
    predicted = []
    for x, r in zip(xs, ok, strict=True):
        if use_tflops and r.get("predicted_tflops_per_gpu") not in ("", None):
            predicted.append((x, float(r["predicted_tflops_per_gpu"])))
        elif not use_tflops and r.get("predicted_iteration_ms") not in ("", None) and r.get("samples_per_second"):
            gbs = float(r["samples_per_second"]) * float(r["iteration_ms_median"]) / 1000.0
            predicted.append((x, gbs / (float(r["predicted_iteration_ms"]) / 1000.0)))
    if predicted:
        ax.scatter(
            [p[0] for p in predicted],
            [p[1] for p in predicted],
            marker="_",
            s=300,
            color="black",
            zorder=3,
            label="predicted (plan)",
        )
    ax.set_xticks(xs)
    ax.set_xticklabels([str(r["id"]) for r in ok], rotation=60, ha="right", fontsize=7)
    ax.set_ylabel(label)
    ax.set_title("measured throughput per configuration")
    handles: list[Any] = [plt.Rectangle((0, 0), 1, 1, color=colors[s]) for s in schedules]  # and a Line2D
    labels = list(schedules)
    if predicted:
        handles.append(plt.Line2D([0], [0], marker="_", color="black", linestyle="", markersize=15))
        labels.append("predicted (plan)")
    ax.legend(handles, labels, fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
