"""``megatron-pp draw``: a simulated schedule's Gantt chart, or (``--html``) the schedule explorer."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..schedule_args import CliError, add_source_args, parse_cli_costs, schedule_from_args
from ..schedules.limits import check_drawn_ops
from .cmd_simulate import simulated
from .support import int_list

HTML_SCHEDULES = "1f1b,interleaved-1f1b,zb-h1,zb-auto,v-half,v-zb,bfs"


def cmd_draw_html(args: argparse.Namespace) -> int:
    """The schedule explorer: one self-contained HTML file with precomputed variants."""
    from ..analysis import html
    from ..analysis.peers import COST_MODELS

    if not str(args.output).lower().endswith((".html", ".htm")):
        raise CliError(f"with --html the output file must end in .html, got {args.output!r}")
    schedules = [args.name] if args.name else [x.strip() for x in args.html_schedules.split(",") if x.strip()]
    ps = [args.p] if args.p else int_list(args.html_p)
    shapes = [(p, args.m) for p in ps] if args.m else [(p, f * p) for p in ps for f in int_list(args.html_m_factors)]
    variants = html.build_variants(schedules, shapes, COST_MODELS)
    try:
        Path(args.output).write_text(html.render(variants))
    except OSError as exc:
        raise CliError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    bad = sum(1 for v in variants.values() if "error" in v)
    print(f"wrote {args.output}: {len(variants)} variants ({bad} not available)")
    return 0


def cmd_draw(args: argparse.Namespace) -> int:
    from ..analysis.plot import draw

    if args.html:
        return cmd_draw_html(args)
    schedule = schedule_from_args(args)
    check_drawn_ops(sum(len(row) for row in schedule.ops))
    result = simulated(schedule, parse_cli_costs(args.costs))
    try:
        out = draw(result, schedule, args.output)
    except OSError as exc:
        raise CliError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    print(f"wrote {out}")
    return 0


def add_parser(subparsers: Any) -> None:
    """Adds ``draw`` to ``megatron-pp``'s sub-commands (its parser, with ``func`` set)."""
    drw = subparsers.add_parser("draw", help="Gantt chart of a simulated schedule")
    add_source_args(drw)
    drw.add_argument("-o", "--output", required=True, help="output file, .png or .svg (.html with --html)")
    drw.add_argument(
        "--html",
        action="store_true",
        help="interactive explorer: one self-contained HTML page with precomputed variants (schedule x p x m x "
        "costs); a schedule name, -p or -m restrict the grid",
    )
    drw.add_argument(
        "--html-schedules",
        default=HTML_SCHEDULES,
        help="schedules in the explorer (comma-separated; torch:<name> for torch.distributed.pipelining's order, "
        "e.g. torch:ZBVZeroBubble)",
    )
    drw.add_argument("--html-p", default="4,8", help="pipeline sizes in the explorer (comma-separated)")
    drw.add_argument("--html-m-factors", default="1,2", help="m = factor * p in the explorer (comma-separated)")
    drw.set_defaults(func=cmd_draw)
