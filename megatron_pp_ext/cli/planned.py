"""The configurations ``grid`` and ``launch-local`` run: a saved plan (``--plan``) or one planned now from the
plan flags, narrowed by ``--best-per-schedule`` and ``--top``."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..planner.files import MAX_PLAN_BYTES, read_capped
from ..planner.options import planner_from_args
from ..planner.plan_report import plan_document


def _plan_row(row: object) -> bool:
    """A plan row the launchers can run: an id and a list of flags."""
    return (
        isinstance(row, dict)
        and isinstance(row.get("id"), str)
        and isinstance(row.get("megatron_args"), list)
        and all(isinstance(a, str) for a in row["megatron_args"])
    )


def load_or_plan(args: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The plan document and its selected rows: from ``--plan`` or by planning now."""
    if args.plan:
        try:
            doc = json.loads(read_capped(args.plan, MAX_PLAN_BYTES, "plan"))
        except ValueError as exc:
            raise ValueError(f"cannot read plan {args.plan}: {str(exc)[:200]}") from None
        if (
            not isinstance(doc, dict)
            or doc.get("format") != "megatron-pp plan v1"
            or not isinstance(doc.get("rows"), list)
        ):
            got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise ValueError(f"{args.plan} is not a megatron-pp plan (format {got!r}, written by `plan --save`)")
        rows = list(doc["rows"])
        bad = next((i for i, r in enumerate(rows) if not _plan_row(r)), None)
        if bad is not None:
            raise ValueError(f"{args.plan}: row {bad} is not a configuration with an 'id' and 'megatron_args'")
    else:
        planner = planner_from_args(args)
        result = planner.run(progress=getattr(args, "progress", None))
        doc = plan_document(result, planner, result.rows)
        rows = list(doc["rows"])
    if args.best_per_schedule:
        seen: dict[str, dict[str, Any]] = {}
        for row in rows:
            key = str(row["schedule"]) + "@" + str(row.get("memory_limit"))
            seen.setdefault("pp=1" if row.get("pp") == 1 else key, row)  # no pipeline: one group
        rows = list(seen.values())
    if args.top:
        rows = rows[: args.top]
    return doc, rows
