"""``megatron-pp collect LOGDIR``: Megatron training logs -> CSV, markdown table and plot.

Reads every ``*.log`` under ``LOGDIR`` (the files ``grid`` and ``launch-local`` write: first line
``# megatron-pp config ID``, last line ``# megatron-pp exit code N``; plain Megatron logs work too,
named by their file stem) and parses what ``megatron.training`` prints:

* the iteration line of ``training_log`` (printed by the last rank)::

     [2026-01-01 10:00:00.123456] iteration       10/      20 | consumed samples: 1280 |
     elapsed time per iteration (ms): 1234.5 | throughput per GPU (TFLOP/s/GPU): 123.4 |
     learning rate: 1.000000E-04 | global batch size:   128 | lm loss: 6.543210E+00 | ...

* ``report_memory``'s ``[Rank R] (after N iterations) memory (MB) | allocated: ... | max allocated:
  ... | reserved: ... | max reserved: ...`` (per data-parallel-rank-0 process),
* ``Theoretical memory footprints: weight and optimizer=... MB, activation=... MB, total=... MB``,
* the timers block ``(min, max) time across ranks (ms):`` (``--timing-log-option minmax``).

A run is ``ok`` when it logged its last iteration, megatron's end-of-training line
(``[after training is done]``) and exited 0 (a log whose last line is cut off is never ``ok``:
that partial line is ignored and the run counts as ``incomplete``), ``exit-error`` when it trained
every iteration (megatron printed ``[after training is done]``) but the process then exited
non-zero (its measurements stand), ``oom`` when the log shows a CUDA / torch out-of-memory error,
``timeout`` for a Slurm time limit, ``failed`` for another error or a non-zero exit code,
``incomplete`` when it stopped without saying why (still running or killed), ``missing`` for a
planned configuration without a log.

Per run: median and mean iteration time over the iterations after ``--skip`` warm-up ones, the
median TFLOP/s per GPU Megatron printed, samples/s from the global batch, the last loss, the
largest ``max allocated`` / ``max reserved`` over ranks; with a plan (``plan.json`` in LOGDIR or
its parent, or ``--plan``) also the predicted iteration time / TFLOP/s / peak memory and the
ratio measured / predicted.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import statistics
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..argtypes import output_dir
from .files import MAX_LOG_BYTES, MAX_PLAN_BYTES, read_capped

__all__ = ["RunLog", "add_parser", "collect", "parse_log", "plot_throughput", "summarize", "write_outputs"]

_ITER = re.compile(r"\biteration\s+(\d+)/\s*(\d+)\s*\|")
_FIELDS = {
    "elapsed_ms": re.compile(r"elapsed time per iteration \(ms\):\s*([0-9.eE+-]+)"),
    "tflops": re.compile(r"throughput per GPU \(TFLOP/s/GPU\):\s*([0-9.eE+-]+)"),
    "loss": re.compile(r"lm loss:\s*([0-9.eE+-]+|nan|inf)", re.IGNORECASE),
    "global_batch": re.compile(r"global batch size:\s*(\d+)"),
    "consumed": re.compile(r"consumed samples:\s*(\d+)"),
    "skipped": re.compile(r"number of skipped iterations:\s*(\d+)"),
    "nan": re.compile(r"number of nan iterations:\s*(\d+)"),
}
_MEMORY = re.compile(
    r"\[Rank (\d+)\] \(after (\d+) iterations\) memory \(MB\) \| allocated: ([0-9.]+) \| max allocated: ([0-9.]+)"
    r" \| reserved: ([0-9.]+) \| max reserved: ([0-9.]+)"
)
_THEORY = re.compile(
    r"Theoretical memory footprints: weight and optimizer=([0-9.]+) MB, activation=([0-9.]+) MB, total=([0-9.]+) MB"
)
_TIMER = re.compile(r"^\s+([A-Za-z0-9_-][A-Za-z0-9 _./-]*?) \.+: \(([0-9.]+), ([0-9.]+)\)\s*$")
_HEADER = re.compile(r"^# megatron-pp config (\S+)")
_EXIT = re.compile(r"^# megatron-pp exit code (-?\d+)")
_OOM = re.compile(r"CUDA out of memory|OutOfMemoryError|out of memory", re.IGNORECASE)
_TIMEOUT = re.compile(r"DUE TO TIME LIMIT|CANCELLED AT .* DUE TO TIME", re.IGNORECASE)
_ERROR_LINE = re.compile(r"^(?:\[[^\]]*\]:?\s*)?([A-Za-z_][A-Za-z0-9_.]*(?:Error|Exception)\b.*)$")


@dataclass
class RunLog:
    """What one log says."""

    path: Path
    config_id: str
    iterations: list[dict[str, float]] = field(default_factory=list)
    memory: dict[int, tuple[float, float, float, float]] = field(default_factory=dict)  # rank -> MB
    theoretical: tuple[float, float, float] | None = None  # weights+optimizer, activation, total (MB)
    timers: dict[str, tuple[float, float]] = field(default_factory=dict)  # last (min, max) ms per timer
    exit_code: int | None = None
    oom: bool = False
    timeout: bool = False
    error: str | None = None
    args: str | None = None
    done: bool = False  # megatron printed "[after training is done]"
    truncated: bool = False  # the file ends in the middle of a line (that line is ignored)

    @property
    def train_iters(self) -> int | None:
        return int(self.iterations[-1]["of"]) if self.iterations else None

    @property
    def status(self) -> str:
        if self.oom:
            return "oom"
        if self.timeout:
            return "timeout"
        finished = bool(self.iterations) and self.iterations[-1]["iteration"] >= self.iterations[-1]["of"]
        if finished and self.done and self.exit_code not in (None, 0):
            return "exit-error"  # trained every iteration, then the process exited abnormally
        if (self.exit_code not in (None, 0)) or (self.error and not finished):
            return "failed"
        if finished and self.done and self.exit_code in (None, 0) and not self.truncated:
            return "ok"  # megatron's end-of-training line too: a log cut short is never "ok"
        return "incomplete"


def parse_log(path: str | Path) -> RunLog:
    p = Path(path)
    text = read_capped(p, MAX_LOG_BYTES, "log")
    run = RunLog(path=p, config_id=p.stem)
    wrapper_error = False
    lines = text.splitlines()
    if text and not text.endswith(("\n", "\r")):
        run.truncated = True  # cut mid-line: a cut "75.27" would read as "7"
        lines = lines[:-1]
    for line in lines:
        header = _HEADER.match(line)
        if header:
            run.config_id = header.group(1)
            continue
        if line.startswith("# args:"):
            run.args = line[len("# args:") :].strip()
            continue
        if line.startswith("[after training is done]"):
            run.done = True
            continue
        code = _EXIT.match(line)
        if code:
            run.exit_code = int(code.group(1))
            continue
        it = _ITER.search(line)
        if it and "elapsed time per iteration" in line:
            entry: dict[str, float] = {"iteration": float(it.group(1)), "of": float(it.group(2))}
            for key, rx in _FIELDS.items():
                match = rx.search(line)
                if match:
                    try:
                        entry[key] = float(match.group(1))
                    except ValueError:
                        entry[key] = float("nan")
            run.iterations.append(entry)
            continue
        mem = _MEMORY.search(line)
        if mem:
            rank = int(mem.group(1))
            values = tuple(float(mem.group(i)) for i in range(3, 7))
            old = run.memory.get(rank)
            run.memory[rank] = values if old is None else tuple(max(a, b) for a, b in zip(old, values, strict=True))  # type: ignore[assignment]
            continue
        theory = _THEORY.search(line)
        if theory:
            run.theoretical = (float(theory.group(1)), float(theory.group(2)), float(theory.group(3)))
            continue
        timer = _TIMER.match(line)
        if timer:
            run.timers[timer.group(1).strip()] = (float(timer.group(2)), float(timer.group(3)))
            continue
        if _OOM.search(line):
            if not run.oom:
                run.error = line.strip()[:300]  # the out-of-memory message says most
            run.oom = True
        if _TIMEOUT.search(line):
            run.timeout = True
            run.error = run.error or line.strip()[:300]
        if line.startswith("terminate called") and (run.error is None or wrapper_error):
            run.error, wrapper_error = line.strip()[:300], False  # a C++ abort (SIGABRT)
            continue
        err = _ERROR_LINE.match(line.strip())
        if err and not run.oom and "Warning" not in err.group(1).split(":")[0]:
            text = err.group(1)[:300]
            # torchrun's wrapper exceptions only repeat a failure reported above them: keep the
            # first real exception, a wrapper only if there is nothing else.
            wrapper = text.startswith(("torch.distributed.elastic", "ChildFailedError"))
            if run.error is None or (wrapper_error and not wrapper):
                run.error, wrapper_error = text, wrapper
    return run


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


MEASURED = ("ok", "exit-error")  # statuses whose iteration times are complete

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


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "collect",
        help="parse Megatron logs of a grid into CSV + markdown + plot (predicted vs measured)",
        description="Parse every *.log under LOGDIR (Megatron's iteration, memory and timer lines) into "
        "results.csv, results.md and throughput.png; marks failed / OOM runs; compares with plan.json.",
    )
    p.add_argument("logdir", help="directory with the runs' logs")
    p.add_argument(
        "more_logdirs",
        nargs="*",
        metavar="LOGDIR",
        help="more log directories (e.g. logs/zb-1.5b logs/zb-6.2b ...): each collected as alone, plus one "
        "paper.md over all of them in --out",
    )
    p.add_argument("--plan", help="plan.json with the predictions (default: LOGDIR/plan.json or ../plan.json)")
    p.add_argument("--out", type=output_dir, help="where to write results.* (default: LOGDIR)")
    p.add_argument("--skip", type=int, default=2, help="warm-up iterations left out of the averages (default 2)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--csv", action="store_true", help="print the CSV instead of the markdown table")
    p.set_defaults(func=cmd_collect)


def cmd_collect(args: argparse.Namespace) -> int:
    logdirs = [args.logdir, *args.more_logdirs]
    if len(logdirs) > 1 and (args.plan or not args.out):
        raise ValueError("several LOGDIRs (one per provided script / model size): give --out DIR, and no --plan")
    from .paper import write_combined_paper

    code, sections = 0, []
    for logdir in logdirs:
        out = args.out if len(logdirs) == 1 else None
        rows, plan, one = _collect_one(logdir, args.plan, out, args)
        code = max(code, one)
        sections.append((logdir, rows, plan))
    if len(logdirs) > 1:
        path = write_combined_paper(sections, args.out)
        print(f"\nwrote {path} (one table per log directory)")
    return code


def _collect_one(
    logdir: str, plan_path: str | None, out: str | None, args: argparse.Namespace
) -> tuple[list[dict[str, Any]], dict[str, Any] | None, int]:
    rows, plan = collect(logdir, plan_path, args.skip)
    if not rows:
        raise ValueError(f"no *.log files under {logdir}")
    paths = write_outputs(rows, out or logdir, plot=not args.no_plot)
    from .paper import paper_markdown, paper_rows, write_paper

    paths.update(write_paper(rows, plan, out or logdir, plot=not args.no_plot))
    print(to_csv(rows) if args.csv else to_markdown(rows))
    if not args.csv:
        print("\n" + paper_markdown(paper_rows(rows, plan)))
    bad = [r for r in rows if r["status"] != "ok"]
    print(
        f"\n{len(rows) - len(bad)} ok, {len(bad)} not ok"
        + (f" ({', '.join(sorted({r['status'] for r in bad}))})" if bad else "")
        + f"; wrote {', '.join(str(p) for p in paths.values())}"
        + ("" if plan else "; no plan.json found: no predictions")
    )
    if all(r["status"] == "missing" for r in rows):
        print(f"{logdir}: every planned configuration is missing (no log): nothing ran", file=sys.stderr)
        return rows, plan, 1
    return rows, plan, 0
