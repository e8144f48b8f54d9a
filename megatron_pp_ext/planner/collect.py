"""``megatron-pp collect LOGDIR``'s rows: one per run log (parsed by :mod:`.log_parse`), next to the plan.

Per run: median and mean iteration time over the iterations after ``--skip`` warm-up ones, the
median TFLOP/s per GPU Megatron printed, samples/s from the global batch, the last loss, the
largest ``max allocated`` / ``max reserved`` over ranks; with a plan (``plan.json`` in LOGDIR or
its parent, or ``--plan``) also the predicted iteration time / TFLOP/s / peak memory and the
ratio measured / predicted. A planned configuration without a log is a ``missing`` row. The CSV and
markdown tables are :mod:`.collect_report`'s, the plot :mod:`.collect_plot`'s.
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .files import MAX_PLAN_BYTES, read_capped
from .log_parse import RunLog, parse_log

__all__ = ["collect", "find_plan", "summarize"]


def _median(values: Sequence[float]) -> float | None:
    clean = [v for v in values if v == v]
    return statistics.median(clean) if clean else None


def summarize(
    run: RunLog, skip: int = 2, plan_row: Mapping[str, Any] | None = None, plan: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """One table row for a run (``plan_row``: its entry in the plan, for meta data and predictions)."""
    its = run.iterations
    steady = its[skip:] if len(its) > skip else its[-1:]
    elapsed = [i["elapsed_ms"] for i in steady if "elapsed_ms" in i]
    tflops = [i["tflops"] for i in steady if i.get("tflops")]  # 0.0: not measured (megatron on CPU)
    med = _median(elapsed)
    gbs = next((i["global_batch"] for i in reversed(its) if "global_batch" in i), None)
    if gbs is None and plan is not None:  # a row's own batch first (plans of several batches: scripts/slurm)
        gbs = float((plan_row or {}).get("global_batch") or plan.get("global_batch", 0)) or None
    row: dict[str, Any] = {"id": run.config_id, "status": run.status}
    meta = plan_row or _meta_from_id(run.config_id)
    for key in ("schedule", "tp", "pp", "dp", "micro_batch", "num_microbatches", "chunks", "recompute"):
        row[key] = meta.get(key, "")
    row.update(
        {
            "iterations": int(its[-1]["iteration"]) if its else 0,
            "train_iters": run.train_iters or "",
            "iteration_ms_median": round(med, 2) if med is not None else "",
            "iteration_ms_mean": round(statistics.fmean(elapsed), 2) if elapsed else "",
            "samples_per_second": round(gbs / (med / 1000.0), 4) if (gbs and med) else "",
            "tflops_per_gpu": _median(tflops) if tflops else "",
            "loss_last": next((i["loss"] for i in reversed(its) if "loss" in i), ""),
            # a CPU run reports 0 MB (no CUDA allocator): not measured, shown as "-"
            "max_allocated_mib": max((m[1] for m in run.memory.values()), default=0.0) or "",
            "max_reserved_mib": max((m[3] for m in run.memory.values()), default=0.0) or "",
            "theoretical_total_mib": run.theoretical[2] if run.theoretical else "",
            "error": run.error or "",
            "log": str(run.path),
        }
    )
    if plan_row is not None:
        pred_s = plan_row.get("iteration_time_s")
        row["predicted_iteration_ms"] = round(1000 * float(pred_s), 2) if pred_s else ""
        row["predicted_tflops_per_gpu"] = plan_row.get("tflops_per_gpu", "")
        row["predicted_peak_memory_gib"] = plan_row.get("peak_memory_gib", "")
        row["measured_over_predicted_time"] = round(med / (1000 * float(pred_s)), 3) if (med and pred_s) else ""
    return row


def _meta_from_id(config_id: str) -> dict[str, Any]:
    """Fields encoded in a planner config id (``NAME-tTpPdD-bBmM-vV-RECOMPUTE``)."""
    match = re.match(r"^(.+?)-t(\d+)p(\d+)d(\d+)-b(\d+)m(\d+)-v(\d+)-(\w+)$", config_id)
    if not match:
        return {}
    name, t, p, d, b, m, v, r = match.groups()
    return {
        "schedule": name.split("@")[0],
        "tp": int(t),
        "pp": int(p),
        "dp": int(d),
        "micro_batch": int(b),
        "num_microbatches": int(m),
        "chunks": int(v),
        "recompute": r,
    }


def find_plan(logdir: Path) -> Path | None:
    for cand in (logdir / "plan.json", logdir.parent / "plan.json"):
        if cand.is_file():
            return cand
    return None


def collect(
    logdir: str | Path, plan_path: str | Path | None = None, skip: int = 2
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Rows for every log under ``logdir`` (and ``missing`` ones for planned configurations
    without a log), plus the plan used."""
    root = Path(logdir)
    if not root.is_dir():
        raise ValueError(f"{logdir} is not a directory")
    plan_file = Path(plan_path) if plan_path else find_plan(root)
    plan: dict[str, Any] | None = None
    if plan_file is not None:
        try:
            plan = json.loads(read_capped(plan_file, MAX_PLAN_BYTES, "plan"))
        except (OSError, ValueError) as exc:
            raise ValueError(f"cannot read plan {plan_file}: {exc}") from None
    if plan is not None:
        _check_plan(plan, plan_file)
    by_id = {str(r["id"]): r for r in plan.get("rows", [])} if plan else {}
    rows = []
    seen = set()
    for path in sorted(root.rglob("*.log")):
        if path.is_dir():  # a folder named x.log: its logs are found on their own
            continue
        run = parse_log(path)
        seen.add(run.config_id)
        rows.append(summarize(run, skip, by_id.get(run.config_id), plan))
    for cid, prow in by_id.items():
        if cid not in seen and plan is not None and ("grid" in plan or "local" in plan):
            empty = RunLog(path=root / f"{cid}.log", config_id=cid)
            row = summarize(empty, skip, prow, plan)
            row["status"] = "missing"
            rows.append(row)
    return rows, plan


_PLAN_NUMBERS = ("iteration_time_s", "tflops_per_gpu", "peak_memory_gib")


def _check_plan(plan: Any, plan_file: Path | None) -> None:
    """The shape ``collect`` reads from a plan: ``{"rows": [{"id": ..., numbers...}, ...], ...}``."""

    def bad(what: str) -> ValueError:
        return ValueError(f"plan {plan_file}: {what} (expected a plan written by `megatron-pp plan --save`)")

    if not isinstance(plan, dict):
        raise bad(f"top level is a {type(plan).__name__}, not an object")
    rows = plan.get("rows", [])
    if not isinstance(rows, list):
        raise bad(f"'rows' is a {type(rows).__name__}, not a list")
    for index, row in enumerate(rows):
        if not isinstance(row, dict) or "id" not in row:
            raise bad(f"row {index} is not an object with an 'id'")
        for key in _PLAN_NUMBERS:
            value = row.get(key)
            if value in (None, "") or (isinstance(value, (int, float)) and not isinstance(value, bool)):
                continue
            raise bad(f"row {index} ({str(row['id'])[:60]}): {key} is {str(value)[:40]!r}, not a number")
    gbs = plan.get("global_batch")
    if gbs not in (None, "") and (isinstance(gbs, bool) or not isinstance(gbs, (int, float))):
        raise bad(f"global_batch is {str(gbs)[:40]!r}, not a number")
