"""The papers' tables predicted: the planner's estimate for each provided Slurm script's own setting
(scripts/slurm/NAME/plan.json, written by `megatron-pp grid --slurm --spec scripts/slurm/specs/NAME.json`)
against the published figures recorded in the specification (``published``).

For every configuration: samples per GPU per second, MFU and the worst rank's memory, plus the
"span" throughput the zero-bubble paper reports (its optimizer post-validation lets consecutive
iterations overlap, so an iteration costs the longest per-rank span, not the global makespan):
``samples/GPU/s x (1 - bubble) / (1 - sync bubble)``. Reads the checked-in plans (no planning).

    python benchmarks/bench_paper_predictions.py [NAME ...]
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
        out.append({**r, "label": label, "batch": batch, "sps": sps, "span_sps": span})
    return out


def table(name: str) -> str:
    spec = json.loads((REPO / "scripts" / "slurm" / "specs" / f"{name}.json").read_text())
    plan = json.loads((REPO / spec["out"] / "plan.json").read_text())
    rows = _rows(plan)
    lines = [f"### {name}: {plan['model']['name']} on {plan['gpus']} x {plan['device']}", ""]
    lines += ["| schedule | B | tp/pp/dp | mb x m | v | samples/GPU/s | span samples/GPU/s | MFU | peak GiB |"]
    lines += ["|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['batch']} | {r['tp']}/{r['pp']}/{r['dp']} | {r['micro_batch']} x "
            f"{r['num_microbatches']} | {r['chunks']} | {r['sps']:.3f} | {r['span_sps']:.3f} | {100 * r['mfu']:.1f}% "
            f"| {r['peak_memory_gib']:.1f} |"
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
                lines.append(
                    f"* B={batch}: {sp['schedule']} / best of {', '.join(sp['over'])} = {max(mine) / max(others):.3f}"
                )
    for claim in pub.get("claims", []):
        lines.append(f"* claim: {claim}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    names = argv or [p.stem for p in sorted((REPO / "scripts" / "slurm" / "specs").glob("*.json"))]
    print("\n\n".join(table(name) for name in names))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
