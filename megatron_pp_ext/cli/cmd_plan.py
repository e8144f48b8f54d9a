"""``megatron-pp plan``: the grid search over TP/PP/DP/micro-batch/schedule/recompute, printed as a table,
JSON or CSV (and saved for ``grid`` and ``launch-local``)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from ..argtypes import nonnegative_int, output_file
from ..planner.memory import GIB
from ..planner.options import add_plan_arguments, planner_from_args, positive_int_list
from ..planner.plan_report import (
    csv_text,
    format_table,
    plan_document,
    select_rows,
    summary_lines,
    table_header,
    table_rows,
)
from ..planner.result import PlanResult
from ..schedule_args import CliError


def add_top_argument(parser: Any, default: int) -> None:
    """``--top``: how many of the best configurations (``plan``, ``grid``, ``launch-local``); 0 = all."""
    parser.add_argument(
        "--top", type=nonnegative_int, default=default, help=f"the N best configurations (default {default}; 0 = all)"
    )


def add_parser(subparsers: Any) -> None:
    """Adds ``plan`` to ``megatron-pp``'s sub-commands."""
    p = subparsers.add_parser(
        "plan",
        help="grid search over TP/PP/DP/micro-batch/schedule/recompute under a memory budget",
        description="Enumerate every valid (TP, PP, DP, micro-batch, virtual stages, schedule, recompute) "
        "configuration, drop those over the memory budget and rank the rest by estimated throughput.",
    )
    add_plan_arguments(p)
    o = p.add_argument_group("output")
    add_top_argument(o, 20)
    o.add_argument("--best-per-schedule", action="store_true", help="only each schedule's best configuration")
    o.add_argument("--json", action="store_true", help="print the plan as JSON")
    o.add_argument("--csv", action="store_true", help="print the ranked rows as CSV")
    o.add_argument(
        "--save", type=output_file, metavar="PLAN.json", help="also write the plan (every fitting row) to this file"
    )
    o.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None, help="progress bar on stderr")
    e = p.add_argument_group("MoE (docs/moe.md, docs/planner.md)")
    e.add_argument(
        "--moe-report",
        action="store_true",
        help="instead of the search: at one shape (the first --pp, --tp, --micro-batch), every schedule at every "
        "expert-parallel size that fits, with and without the overlap of its F&B pairs, and which wins",
    )
    e.add_argument(
        "--ep", type=positive_int_list, default=None, help="expert-parallel sizes to try (default: every divisor of DP)"
    )
    p.set_defaults(func=cmd_plan)


def print_models() -> None:
    import textwrap

    from ..planner.models import models_table

    rows = models_table()
    header = [k for k in rows[0] if k not in ("assumed", "source")]  # long texts: on their own lines
    table = format_table(header, [[str(r[k]) for k in header] for r in rows]).splitlines()
    print("\n".join(table[:2]))
    for line, row in zip(table[2:], rows, strict=True):
        print(line)
        for key in ("source", "assumed"):
            if row[key] != "-":
                print(textwrap.fill(f"{key}: {row[key]}", 100, initial_indent="    ", subsequent_indent="      "))


def cmd_plan(args: argparse.Namespace) -> int:
    """Print (and save) the plan; exit status 1, with the reason on stderr, when no configuration fits."""
    if args.list_models:
        print_models()
        return 0
    if args.ep is not None and not args.moe_report:
        raise ValueError("--ep: only with --moe-report")
    planner = planner_from_args(args)
    if args.moe_report:
        return moe_report(args, planner)
    result = planner.run(progress=args.progress)
    top = None if args.top == 0 else args.top
    rows = select_rows(result, args.best_per_schedule, top)
    if args.save:
        _save(args.save, plan_document(result, planner, result.rows))
    if args.json:
        doc = plan_document(result, planner, rows)
        doc["summary"] = summary_lines(result, planner)
        print(json.dumps(doc))
        return _nothing_fits(result)
    if args.csv:
        print(csv_text(rows), end="")
        return _nothing_fits(result)
    if tuple(args.schedules or ()) == ("auto",):
        from ..planner.auto import AutoDecision

        print(AutoDecision(result).table())
        print()
    if rows:
        print(format_table(table_header(rows), table_rows(rows)))
    else:
        print("no configuration fits (see below)")
    print()
    print("\n".join(summary_lines(result, planner)))
    if args.save:
        print(f"wrote {args.save} ({len(result.rows)} configurations)")
    return _nothing_fits(result)


def moe_report(args: argparse.Namespace, planner: Any) -> int:
    """``plan --moe-report``: the MoE comparison at one shape (planner/moe_plan.py)."""
    from ..planner.moe_plan import MoeShape, moe_report_text, moe_rows

    model = planner.model
    shape = MoeShape(
        gpus=planner.num_gpus,
        pp=(args.pp or (2,))[0],
        tp=(args.tp or (1,))[0],
        micro_batch=(args.micro_batch or (model.default_micro_batch or 1,))[0],
        global_batch=planner.global_batch,
    )
    names = list(planner.schedule_names)
    rows, skipped, dropped = moe_rows(model, planner.costs, shape, names, args.ep, planner.budget_bytes)
    print(moe_report_text(model, shape, rows, skipped, dropped))
    if not rows:
        print("megatron-pp: error: --moe-report: no schedule and EP size fits (reasons above)", file=sys.stderr)
        return 1
    return 0


def _save(path: str, doc: dict[str, Any]) -> None:
    """Write the plan; a failed write (a full disk, say) is one error line naming the file, not a traceback."""
    try:
        Path(path).write_text(json.dumps(doc, indent=1) + "\n")
    except OSError as exc:
        raise CliError(f"argument --save: cannot write {path}: {exc.strerror or exc}") from None


def _nothing_fits(result: PlanResult) -> int:
    """0 when some configuration fits; else 1 and one line on stderr saying why (the summary has the detail)."""
    if result.rows:
        return 0
    why = []
    if result.over_budget:
        best = min(result.over_budget_best.values(), default=0.0) / GIB
        why.append(
            f"{result.over_budget} over the memory budget of {result.budget_bytes / GIB:.3g} GiB "
            f"(the smallest needs {best:.3g} GiB: raise --memory-budget, add GPUs or recompute)"
        )
    inapplicable = sum(sum(c.values()) for c in result.inapplicable.values())
    if inapplicable:
        why.append(f"{inapplicable} schedule/shape pairs not applicable (reasons in the summary)")
    print(
        f"megatron-pp: error: no configuration fits: {'; '.join(why) or 'nothing was searched'}",
        file=sys.stderr,
    )
    return 1
