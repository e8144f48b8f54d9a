"""``megatron-pp collect``'s paper-style table: throughput per GPU, MFU and memory per schedule
(rows) and global batch / micro-batch count (columns), measured next to the plan's prediction, as
the zero-bubble, controllable-memory and breadth-first papers lay out their results. Written as
``paper.md`` and ``paper.png`` next to ``results.*``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["paper_markdown", "paper_rows", "plot_paper", "write_paper"]


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or value in (None, ""):
        return None
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if out == out else None


def _peak_tflops(plan: Mapping[str, Any] | None) -> float | None:
    if not plan or not plan.get("device"):
        return None
    from .cost_model import get_device

    try:
        return float(get_device(str(plan["device"])).peak_tflops)
    except ValueError:
        return None


def paper_rows(rows: Sequence[Mapping[str, Any]], plan: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """One entry per configuration: schedule label, global batch, measured and predicted samples
    per GPU per second, MFU and peak memory (GiB)."""
    plan_rows = {str(r.get("id")): r for r in (plan or {}).get("rows", []) if isinstance(r, dict)}
    peak = _peak_tflops(plan)
    out = []
    for row in rows:
        cid = str(row.get("id", ""))
        prow = plan_rows.get(cid, {})
        tp, pp, dp = (_num(row.get(k)) or _num(prow.get(k)) for k in ("tp", "pp", "dp"))
        gpus = tp * pp * dp if tp and pp and dp else _num((plan or {}).get("gpus"))
        mb, m = _num(row.get("micro_batch")), _num(row.get("num_microbatches"))
        batch = _num(prow.get("global_batch")) or (dp * mb * m if dp and mb and m else None)
        limit = prow.get("memory_limit") or (cid.split("-t")[0].split("@")[1] if "@" in cid.split("-t")[0] else None)
        label = str(row.get("schedule", "?")) + (f"@{limit}" if limit else "")
        sps, pred_s = _num(row.get("samples_per_second")), _num(prow.get("iteration_time_s"))
        tflops, pred_tflops = _num(row.get("tflops_per_gpu")), _num(prow.get("tflops_per_gpu"))
        alloc = _num(row.get("max_allocated_mib"))
        out.append(
            {
                "schedule": label,
                "global_batch": int(batch) if batch else None,
                "status": row.get("status", ""),
                "samples_per_gpu_s": sps / gpus if sps is not None and gpus else None,
                "predicted_samples_per_gpu_s": batch / pred_s / gpus if batch and pred_s and gpus else None,
                "mfu": tflops / peak if tflops and peak else None,
                "predicted_mfu": pred_tflops / peak if pred_tflops and peak else None,
                "memory_gib": alloc / 1024 if alloc is not None else None,
                "predicted_memory_gib": _num(prow.get("peak_memory_gib")),
            }
        )
    return out


def _cell(measured: float | None, predicted: float | None, fmt: str) -> str:
    m = format(measured, fmt) if measured is not None else "-"
    return m + (f" ({format(predicted, fmt)})" if predicted is not None else "")


def paper_markdown(entries: Sequence[Mapping[str, Any]]) -> str:
    """Schedules as rows, global batches as column groups; each cell ``measured (predicted)``."""
    batches = sorted({e["global_batch"] for e in entries if e["global_batch"]})
    labels = list(dict.fromkeys(e["schedule"] for e in entries))
    best: dict[tuple[str, int | None], Mapping[str, Any]] = {}
    for e in entries:  # several configurations of one schedule at one batch: keep the fastest measured
        key = (e["schedule"], e["global_batch"])
        old = best.get(key)
        if old is None or (e["samples_per_gpu_s"] or 0) > (old["samples_per_gpu_s"] or 0):
            best[key] = e
    header = ["schedule"]
    for b in batches:
        header += [f"B={b} samples/GPU/s", f"B={b} MFU", f"B={b} mem GiB"]
    lines = [
        "measured (predicted by the plan); samples per GPU per second, model FLOPs utilisation, peak allocated memory",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
    ]
    for label in labels:
        cells = [label]
        for b in batches:
            cell = best.get((label, b))
            if cell is None:
                cells += ["", "", ""]
                continue
            status = "" if cell["status"] == "ok" else f" [{cell['status']}]"
            cells += [
                _cell(cell["samples_per_gpu_s"], cell["predicted_samples_per_gpu_s"], ".3f") + status,
                _cell(cell["mfu"], cell["predicted_mfu"], ".1%"),
                _cell(cell["memory_gib"], cell["predicted_memory_gib"], ".1f"),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_paper(entries: Sequence[Mapping[str, Any]], path: str | Path) -> Path | None:
    """Grouped bars: samples per GPU per second for each schedule at each global batch; the plan's
    prediction as a black tick. ``None`` when nothing was measured."""
    measured = [e for e in entries if e["samples_per_gpu_s"] is not None and e["global_batch"]]
    if not measured:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({e["global_batch"] for e in measured})
    labels = list(dict.fromkeys(e["schedule"] for e in measured))
    width = 0.8 / max(1, len(labels))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(batches) + 2), 4.5))
    for i, label in enumerate(labels):
        for j, b in enumerate(batches):
            es = [e for e in measured if e["schedule"] == label and e["global_batch"] == b]
            if not es:
                continue
            e = max(es, key=lambda x: x["samples_per_gpu_s"])
            x = j + (i - (len(labels) - 1) / 2) * width
            ax.bar(
                x, e["samples_per_gpu_s"], width, color=plt.get_cmap("tab10")(i % 10), label=label if j == 0 else None
            )
            if e["predicted_samples_per_gpu_s"] is not None:
                ax.plot([x - width / 2, x + width / 2], [e["predicted_samples_per_gpu_s"]] * 2, color="black")
    ax.set_xticks(range(len(batches)))
    ax.set_xticklabels([f"global batch {b}" for b in batches])
    ax.set_ylabel("samples per GPU per second")
    ax.set_title("measured throughput per schedule (black: predicted by the plan)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def write_paper(
    rows: Sequence[Mapping[str, Any]], plan: Mapping[str, Any] | None, out_dir: str | Path, plot: bool = True
) -> dict[str, Path]:
    entries = paper_rows(rows, plan)
    out = Path(out_dir)
    paths = {"paper": out / "paper.md"}
    paths["paper"].write_text(paper_markdown(entries) + "\n")
    if plot:
        png = plot_paper(entries, out / "paper.png")
        if png is not None:
            paths["paper_plot"] = png
    return paths


def write_combined_paper(
    sections: Sequence[tuple[str, Sequence[Mapping[str, Any]], Mapping[str, Any] | None]], out_dir: str | Path
) -> Path:
    """One ``paper.md`` over several log directories (the papers' tables span model sizes): a section
    per directory, titled with its model and GPU count."""
    parts = ["# Results per model size", ""]
    for logdir, rows, plan in sections:
        model = (plan or {}).get("model", {}).get("name", "?") if isinstance((plan or {}).get("model"), dict) else "?"
        parts += [f"## {model} on {(plan or {}).get('gpus', '?')} GPUs ({logdir})", ""]
        parts += [paper_markdown(paper_rows(rows, plan)), ""]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "paper.md"
    path.write_text("\n".join(parts))
    return path
