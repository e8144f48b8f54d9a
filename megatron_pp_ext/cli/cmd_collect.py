"""``megatron-pp collect LOGDIR``: Megatron training logs -> ``results.csv``, ``results.md``, ``throughput.png``
and the paper-style table (measured next to the plan's predictions)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..argtypes import output_dir
from ..planner.collect import collect
from ..planner.collect_report import to_csv, to_markdown, write_outputs


def add_parser(subparsers: Any) -> None:
    """Adds ``collect`` to ``megatron-pp``'s sub-commands (its parser, with ``func`` set)."""
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
    from ..planner.paper import write_combined_paper

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
    from ..planner.paper import paper_markdown, paper_rows, write_paper

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
