"""The papers' tables predicted: the planner's estimate for each provided Slurm script's own setting
(scripts/slurm/NAME/plan.json, written by `megatron-pp grid --slurm --spec scripts/slurm/specs/NAME.json`)
against the published figures recorded in the specification (``published``).

For every configuration: samples per GPU per second, MFU and the worst rank's memory, plus the
"span" throughput the zero-bubble paper reports (its optimizer post-validation lets consecutive
iterations overlap, so an iteration costs the longest per-rank span, not the global makespan):
``samples/GPU/s x (1 - bubble) / (1 - sync bubble)``. Reads the checked-in plans (no planning).

    python benchmarks/bench_paper_predictions.py [NAME ...]

``--fsdp NAME ...`` re-plans those specifications (no checked-in file changes) with FSDP inside the pipeline
as a candidate axis (``plan --fsdp both``; untied embeddings, as ``--pipeline-fsdp`` requires) and prints the
same table, with each row's exposed data-parallel time and FSDP gathers. The provided scripts keep their
unsharded rows: ``--pipeline-fsdp`` trains fp32 only for now, so a bf16 FSDP row is a prediction, not a
runnable configuration yet.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _rows(plan: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for r in plan["rows"]:
        batch = int(r.get("global_batch") or plan["global_batch"])
        sps = batch / float(r["iteration_time_s"]) / int(plan["gpus"])
        span = sps * (1 - float(r["bubble_rate"])) / max(1e-9, 1 - float(r["sync_bubble_rate"]))
        label = str(r["schedule"]) + (f"@{r['memory_limit']}" if r.get("memory_limit") else "")
        label += f"/U{r['unit_size']}" if r.get("unit_size") is not None else ""
        out.append({**r, "label": label, "batch": batch, "sps": sps, "span_sps": span})
    return out


def fsdp_plan(name: str) -> dict[str, Any]:
    """The plan of specification ``name`` re-made with FSDP as a candidate axis (module doc): per global
    batch, the best row of each schedule with and without FSDP; each row also gets the samples per GPU
    per second it would have with its whole data-parallel reduction after the pipeline (no overlap, as
    Megatron-LM reduced gradients before 2023: ``"sps_reduce_after"``)."""
    from dataclasses import replace

    from megatron_pp_ext.planner.options import planner_from_args
    from megatron_pp_ext.planner.plan_report import plan_document
    from megatron_pp_ext.planner.specs import load_spec, planner_args

    spec = load_spec(REPO / "scripts" / "slurm" / "specs" / f"{name}.json")
    spec = replace(spec, plan_flags=(*spec.plan_flags, "--fsdp", "both", "--untie-embeddings-and-output-weights"))
    doc: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    for batch in spec.global_batches:
        planner = planner_from_args(planner_args(spec, batch))
        result = planner.run(progress=False)
        best: dict[tuple[str, bool], Any] = {}
        for row in result.rows:
            if row.config.pp > 1:
                best.setdefault((row.config.schedule, row.config.fsdp), row)
        part = plan_document(result, planner, list(best.values()))
        for row, entry in zip(best.values(), part["rows"], strict=True):
            c = row.config
            whole = row.dp_time
            if not c.fsdp:
                whole = max(planner.costs.dp_time(m.parameters, c.tp, c.dp) for m in row.memory)
            iteration = row.pipeline_time + whole + row.optimizer_time
            entry["global_batch"] = batch
            entry["sps_reduce_after"] = batch / iteration / planner.num_gpus
        doc = {**part, "rows": rows}
        rows += part["rows"]
    return doc


def table(name: str, plan: dict[str, Any] | None = None) -> str:
    spec = json.loads((REPO / "scripts" / "slurm" / "specs" / f"{name}.json").read_text())
    fsdp = plan is not None
    if plan is None:
        plan = json.loads((REPO / spec["out"] / "plan.json").read_text())
    rows = _rows(plan)
    title = f"### {name}: {plan['model']['name']} on {plan['gpus']} x {plan['device']}"
    lines = [title + (" (re-planned with FSDP as a candidate axis)" if fsdp else ""), ""]
    extra = " exposed DP ms | fsdp gathers | samples/GPU/s, DP reduced after the pipeline |" if fsdp else ""
    lines += ["| schedule | B | tp/pp/dp | mb x m | v | samples/GPU/s | span samples/GPU/s | MFU | peak GiB |" + extra]
    lines += ["|---|---|---|---|---|---|---|---|---|" + ("---|---|---|" if fsdp else "")]
    for r in rows:
        cells = (
            f" {1e3 * float(r['dp_time_s']):.1f} | {r.get('gathers_per_iteration', '-')} | "
            f"{r['sps_reduce_after']:.3f} |"
            if fsdp
            else ""
        )
        lines.append(
            f"| {r['label']}{' +fsdp' if r.get('fsdp') else ''} | {r['batch']} | {r['tp']}/{r['pp']}/{r['dp']} | "
            f"{r['micro_batch']} x {r['num_microbatches']} | {r['chunks']} | {r['sps']:.3f} | {r['span_sps']:.3f} | "
            f"{100 * r['mfu']:.1f}% | {r['peak_memory_gib']:.1f} |" + cells
        )
    pub = spec.get("published") or {}
    if pub:
        lines += ["", f"Published ({pub.get('source', '')}):", ""]
    for p in pub.get("rows", []):
        match = [r for r in rows if r["label"] == p["schedule"] and r["batch"] == p["global_batch"]]
        if not match:
            lines.append(f"* {p['label']}: no predicted row")
            continue
        r = match[0]
        if "samples_per_gpu_s" in p:
            for what, value in (("samples/GPU/s", r["sps"]), ("span samples/GPU/s", r["span_sps"])):
                diff = value / p["samples_per_gpu_s"] - 1
                lines.append(
                    f"* {p['label']} {what}: predicted {value:.3f}, published {p['samples_per_gpu_s']}"
                    f" ({100 * diff:+.1f}%)"
                )
        if "memory_gb" in p:
            lines.append(
                f"* {p['label']} peak memory: predicted {r['peak_memory_gib']:.1f} GiB, published {p['memory_gb']} GB"
            )
        if "mfu" in p:
            diff = r["mfu"] / p["mfu"] - 1
            lines.append(
                f"* {p['label']} MFU: predicted {100 * r['mfu']:.2f}%, published {100 * p['mfu']:.2f}%"
                f" ({100 * diff:+.1f}%)"
            )
    if len(pub.get("rows", [])) >= 2 and all("mfu" in p for p in pub["rows"]):
        a, b = pub["rows"][0], pub["rows"][1]
        ra = next(r for r in rows if r["label"] == a["schedule"])
        rb = next(r for r in rows if r["label"] == b["schedule"])
        lines.append(
            f"* {a['label']} / {b['label']}: predicted {ra['mfu'] / rb['mfu']:.3f}, published {a['mfu'] / b['mfu']:.3f}"
        )
    sp = pub.get("speedup")
    if sp:
        for batch in sorted({r["batch"] for r in rows}):
            at = [r for r in rows if r["batch"] == batch]
            mine = [r["sps"] for r in at if r["schedule"] == sp["schedule"]]
            others = [r["sps"] for r in at if r["schedule"] in sp["over"]]
            if mine and others:
                line = (
                    f"* B={batch}: {sp['schedule']} / best of {', '.join(sp['over'])} = {max(mine) / max(others):.3f}"
                )
                if fsdp:
                    after = [r["sps_reduce_after"] for r in at if r["schedule"] in sp["over"]]
                    line += f"; over baselines reducing after the pipeline: {max(mine) / max(after):.3f}"
                lines.append(line)
    for claim in pub.get("claims", []):
        lines.append(f"* claim: {claim}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    fsdp = "--fsdp" in argv
    argv = [a for a in argv if a != "--fsdp"]
    names = argv or [p.stem for p in sorted((REPO / "scripts" / "slurm" / "specs").glob("*.json"))]
    print("\n\n".join(table(name, fsdp_plan(name) if fsdp else None) for name in names))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
