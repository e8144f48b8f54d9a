"""How a plan is shown: the ranked table, its summary (what was searched, what did not fit or apply and
why), the JSON document a plan is saved as and the CSV rows."""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from .fsdp_axis import RUNTIME_NOTE
from .megatron_args import config_args, model_args, precision_args
from .memo import SIM_OVERLAP
from .memory import GIB
from .result import PlanResult, PlanRow
from .space import NO_PIPELINE, Config

if TYPE_CHECKING:
    from .search import Planner


TABLE_HEADER = (
    "#",
    "schedule",
    "tp",
    "pp",
    "dp",
    "mb",
    "m",
    "v",
    "recompute",
    "iter s",
    "samples/s",
    "tok/s/GPU",
    "TFLOP/s/GPU",
    "MFU",
    "peak GiB (rank)",
    "bubble",
    "sync bubble",
    "fsdp",
    "gathers",
    "DP exposed ms",
)


def row_label(config: Config) -> str:
    """A row's schedule as the table shows it: name, ``@memory limit``, ``/U`` unit size."""
    if config.pp == 1:
        return NO_PIPELINE
    label = config.schedule + (f"@{config.memory_limit}" if config.memory_limit else "")
    return label + (f"/U{config.unit_size}" if config.unit_size is not None else "")


def table_header(rows: Sequence[PlanRow]) -> tuple[str, ...]:
    """The table's columns: :data:`TABLE_HEADER`, and ``layout`` when a row has a planned layer layout."""
    return (*TABLE_HEADER, "layout") if any(r.config.layout for r in rows) else TABLE_HEADER


def table_rows(rows: Sequence[PlanRow]) -> list[list[str]]:
    """One line per row, with the ``layout`` column when :func:`table_header` has it (``-``: uniform split)."""
    layouts = any(r.config.layout for r in rows)
    out = []
    for r in rows:
        c = r.config
        out.append(
            [
                str(r.rank),
                row_label(c),
                str(c.tp),
                str(c.pp),
                str(c.dp),
                str(c.micro_batch),
                str(c.num_microbatches) + ("~?" if r.approximate else "~" if r.extrapolated else ""),
                str(c.chunks),
                c.recompute,
                f"{r.iteration_time:.4g}",
                f"{r.samples_per_second:.4g}",
                f"{r.tokens_per_second_per_gpu:.5g}",
                f"{r.tflops_per_gpu:.4g}",
                f"{100 * r.mfu:.1f}%",
                f"{r.peak_memory / GIB:.1f} ({r.peak_rank})",
                f"{r.bubble_rate:.4f}",
                f"{r.sync_bubble_rate:.4f}",
                "fsdp" if c.fsdp else "-",
                str(r.gathers) if c.fsdp else "-",
                f"{r.dp_time * 1e3:.3g}",
                *([c.layout or "-"] if layouts else []),
            ]
        )
    return out


def format_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    cells = [list(header), *[list(r) for r in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def summary_lines(result: PlanResult, planner: Planner) -> list[str]:
    lines = [
        f"searched {result.evaluated} configurations in {result.elapsed:.1f} s ({result.cpu:.1f} s CPU; "
        f"{result.stats.get('schedules built', 0)} schedules built, "
        f"{result.stats.get('simulations', 0)} simulations); "
        f"{len(result.rows)} fit in {result.budget_bytes / GIB:.1f} GiB, {result.over_budget} over budget",
        f"model {planner.model.name} ({planner.model.num_parameters() / 1e9:.2f}B parameters), "
        f"{planner.num_gpus} GPUs, global batch {planner.global_batch}; {planner.costs.describe()}",
        "m~ = extrapolated from three shorter simulations (m~? = approximately); peak = worst rank's weights + grads + "
        "optimizer + activations; bubble = zero-bubble paper's (per-rank span), sync bubble = global makespan; "
        "DP exposed = data-parallel time the iteration adds after the pipeline (fsdp: gather stalls + reduce drain, "
        "simulated; /U = zeropp's unit size",
    ]
    if any(r.config.fsdp for r in result.rows):
        lines.append(RUNTIME_NOTE)
    fitting = {r.config.schedule + (f"@{r.config.memory_limit}" if r.config.memory_limit else "") for r in result.rows}
    for label, peak in sorted(result.over_budget_best.items()):
        if label not in fitting:
            lines.append(f"  {label}: every configuration over budget (smallest needs {peak / GIB:.1f} GiB)")
    for name, reasons in sorted(result.inapplicable.items()):
        top = reasons.most_common(2)
        shown = "; ".join(f"{why} (x{n})" for why, n in top)
        lines.append(f"  {name}: {sum(reasons.values())} shape(s) not applicable: {shown}")
    return lines


def plan_document(result: PlanResult, planner: Planner, rows: Sequence[PlanRow]) -> dict[str, Any]:
    """The JSON a plan is saved as (``--save``; read by ``grid``, ``launch-local`` and ``collect``)."""
    setup = planner.setup
    docs = []
    for row in rows:
        entry = row.to_json_dict()
        entry["megatron_args"] = config_args(row.config, setup, planner.global_batch, planner.model)
        docs.append(entry)
    doc = {
        "format": "megatron-pp plan v1",
        "model": planner.model.to_json_dict(),
        "gpus": planner.num_gpus,
        "global_batch": planner.global_batch,
        "device": planner.costs.device.name,
        "gpus_per_node": planner.costs.device.gpus_per_node,
        "setup": asdict(setup),
        "model_args": model_args(planner.model),
        "precision_args": precision_args(setup),
        "memory_budget_gib": round(result.budget_bytes / GIB, 3),
        "searched": result.evaluated,
        "rows": docs,
    }
    if planner.overlap != SIM_OVERLAP:  # only when given (the provided plans predate the flag)
        doc["overlap"] = planner.overlap
    return doc


def select_rows(result: PlanResult, best_per_schedule: bool, top: int | None) -> list[PlanRow]:
    rows = result.best_per_schedule() if best_per_schedule else list(result.rows)
    return rows if top is None else rows[:top]


def csv_text(rows: Sequence[PlanRow]) -> str:
    """The rows as CSV (one column per key of :meth:`PlanRow.to_json_dict`, without the per-rank memory)."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    keys = list(dict.fromkeys(k for row in rows for k in row.to_json_dict(per_rank=False))) or ["id"]
    writer.writerow(keys)
    for row in rows:
        d = row.to_json_dict(per_rank=False)
        writer.writerow([_csv_cell(d.get(k, "")) for k in keys])
    return out.getvalue()


def _csv_cell(value: Any) -> Any:
    return "/".join(map(str, value)) if isinstance(value, list) else value
