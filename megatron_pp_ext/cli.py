"""``megatron-pp``: list, simulate, compare, validate and draw pipeline schedules.

Pure Python on every path except ``verify`` (which needs the torch runtime and is loaded
only when asked for). Exit codes: 0 success, 1 an invalid schedule file (``validate``),
2 bad input (unknown schedule, impossible parameters, unreadable file).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import argtypes
from .schedule_args import (  # noqa: F401  (parse_memory_limit: re-exported for callers of the CLI's helpers)
    PROG,
    CliError,
    add_source_args,
    dp_options,
    generate_schedule,
    parse_costs,
    parse_memory_limit,
    schedule_from_args,
)
from .schedules import registry
from .schedules.ir import ScheduleError
from .schedules.schedule import Schedule

if TYPE_CHECKING:
    from .analysis.simulate import Costs, SimResult
    from .schedules.lowering import LoweredSchedule

EXIT_INVALID = 1
EXIT_USAGE = 2


def _step_times(text: str) -> float | list[float]:
    """``--step-time``: one time >= 0, or one per rank, comma-separated."""
    values = [argtypes.nonnegative_float(part) for part in text.split(",")]
    return values[0] if len(values) == 1 else values


def _simulate(schedule: Schedule, costs: Costs | None, lowered: LoweredSchedule | None = None) -> SimResult:
    from .analysis.simulate import simulate
    from .analysis.validate import validate

    if lowered is None:
        lowered = validate(schedule)
    return simulate(schedule, costs, lowered=lowered)


def _fmt_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [list(map(str, header))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _num(x: float) -> str:
    return f"{x:.6g}"


# ---- subcommands ---------------------------------------------------------------------------
LIST_WIDTH = 100  # `megatron-pp list` fits a 100-column terminal


def cmd_list(args: argparse.Namespace) -> int:
    """One line per schedule (name, placement, B/W split), then its description and constraints
    wrapped below it."""
    import textwrap

    infos = [registry.get(name) for name in registry.names()]
    name_w = max(len("name"), *(len(i.name) for i in infos))
    place_w = max(len("placement"), *(len(i.placement) for i in infos))
    indent = " " * 4
    print(f"{'name'.ljust(name_w)}  {'placement'.ljust(place_w)}  B/W split")
    print(f"{'-' * name_w}  {'-' * place_w}  ---------")
    for info in infos:
        print(f"{info.name.ljust(name_w)}  {info.placement.ljust(place_w)}  {'yes' if info.splits_backward else 'no'}")
        for text in (info.description, f"constraints: {info.requirements}"):
            print(textwrap.fill(text, LIST_WIDTH, initial_indent=indent, subsequent_indent=indent + "  "))
    return 0


def summary(schedule: Schedule, result: SimResult) -> str:
    worst = max(range(schedule.num_ranks), key=lambda r: result.peak_activations[r])
    lines = [
        f"schedule        {schedule.name} ({schedule.placement.style} placement): p={schedule.num_ranks} "
        f"m={schedule.num_microbatches} v={schedule.chunks_per_rank} stages={schedule.num_stages}",
        f"makespan        {_num(result.makespan)}",
        f"bubble rate     {result.bubble_rate:.4f} (longest per-rank span)",
        f"sync bubble     {result.sync_bubble_rate:.4f} (global makespan)",
        f"peak activation {_num(result.peak_activations[worst])} stage units = "
        f"{_num(result.peak_activations_1f1b_units[worst])} 1F1B units (rank {worst})",
        f"communication   {result.p2p_messages} p2p messages, {result.local_handoffs} local hand-offs",
    ]
    block = building_block_of(schedule)
    if block is not None:
        bound, steady = _num(block["memory_bound"]), _num(block["steady_peak"])  # type: ignore[arg-type]
        lines.append(
            f"building block  {block['block']}: interval {block['interval']} slots, lifespan {block['lifespan']} "
            f"slots, memory bound {bound} M_a (steady-state peak {steady} M_a)"
        )
    lines.append("")
    rows = [
        [
            r,
            _num(result.busy[r]),
            _num(result.idle[r]),
            f"{result.bubble_rate_per_rank[r]:.4f}",
            f"{result.sync_bubble_rate_per_rank[r]:.4f}",
            _num(result.peak_activations[r]),
            _num(result.peak_activations_1f1b_units[r]),
        ]
        for r in range(schedule.num_ranks)
    ]
    header = ["rank", "busy", "idle", "bubble", "sync bubble", "peak act (stage)", "peak act (1F1B)"]
    return "\n".join(lines) + _fmt_table(header, rows)


BLOCK_KEYS = ("block", "interval", "lifespan", "memory_bound", "steady_peak")


def building_block_of(schedule: Schedule) -> dict[str, object] | None:
    """The building block a schedule was made from (name, interval and lifespan in slots, memory
    bound and steady-state peak in M_a), or None."""
    if not all(key in schedule.params for key in BLOCK_KEYS):
        return None
    return {key: schedule.params[key] for key in BLOCK_KEYS}


# ---- data parallelism (simulate --dp ...) ---------------------------------------------------------
def data_parallel_summary(result: SimResult) -> str:
    """The --dp part of the simulate report: exposed data-parallel time per rank, chunk reductions."""
    dp = result.data_parallel
    assert dp is not None
    policy = dp.plan.policy
    fsdp = "" if policy.fsdp_max_unsharded is None else f", FSDP with {policy.fsdp_max_unsharded} gathered chunk(s)"
    if policy.grad_reduce_unit is not None:
        fsdp += f", gradients reduced per unit of {policy.grad_reduce_unit} micro-batches"
    dist = ", distributed optimizer (param gather per chunk)" if policy.param_sync else ""
    lines = [
        f"data parallel   dp={dp.dp}, {dp.reduce} per chunk{fsdp}{dist}; times in ms (--costs read as ms)",
        f"iteration       {_num(dp.iteration_time)} (compute ends {_num(max(dp.compute_end))}, "
        f"worst exposed data-parallel time {_num(max(dp.exposed))})",
        "",
    ]
    rows = [
        [
            r,
            _num(dp.exposed[r]),
            _num(dp.stall[r]),
            _num(dp.tail[r]),
            _num(dp.stream_busy[r]),
            dp.gathers(r),
            dp.reduction_count(r),
        ]
        for r in range(len(dp.end))
    ]
    header = ["rank", "exposed dp", "gather stall", "drain tail", "stream busy", "gathers", "reductions"]
    lines.append(_fmt_table(header, rows))
    lines += ["", "gradient reductions (rank, chunk, stage, start, end):"]
    placement = dp.plan.schedule.placement
    rows = [
        [rank, placement.chunk_of(stage), stage, _num(start), _num(end)] for rank, stage, start, end in dp.reductions()
    ]
    lines.append(_fmt_table(["rank", "chunk", "stage", "start", "end"], rows))
    return "\n".join(lines)


def cmd_simulate(args: argparse.Namespace) -> int:
    from .analysis.simulate import simulate
    from .analysis.validate import validate

    schedule = schedule_from_args(args)
    options = dp_options(args, schedule)
    if not 0.0 <= args.overlap <= 1.0:
        raise CliError(f"--overlap must be in [0, 1], got {args.overlap}")
    if isinstance(args.step_time, list) and len(args.step_time) != schedule.num_ranks:
        raise CliError(
            f"--step-time lists {len(args.step_time)} times: give one, or one per rank ({schedule.num_ranks})"
        )
    repeat = {"iterations": args.iterations, "post_validation": args.post_validation, "step_time": args.step_time}
    if options and (args.iterations > 1 or args.post_validation or args.step_time != 0.0):
        raise CliError("--iterations / --post-validation / --step-time are simulated without --dp only")
    w_retained = 1.0 if args.w_memory is None else args.w_memory
    if options:
        result = simulate(
            schedule, parse_costs(args.costs), lowered=validate(schedule), w_retained_fraction=w_retained, **options
        )
    else:
        result = simulate(
            schedule,
            parse_costs(args.costs),
            lowered=validate(schedule),
            overlap=args.overlap,
            w_retained_fraction=w_retained,
            **repeat,  # type: ignore[arg-type]
        )
    if args.json:
        data = result.to_json_dict()
        block = building_block_of(schedule)
        if block is not None:
            data["building_block"] = block
        print(json.dumps(data))
        return 0
    print(summary(schedule, result))
    if result.data_parallel is not None:
        print()
        print(data_parallel_summary(result))
    if result.iterations is not None:
        it = result.iterations
        sync = "optimizer post-validation (no step synchronisation)" if it.post_validation else "synchronous step"
        note = "" if it.count > 1 else " (one iteration: give --iterations >= 2 for the steady state)"
        print()
        print(f"iterations      {it.count} back to back, {sync}; per iteration {_num(it.time)}{note}")
    if args.show:
        print()
        print(schedule.table())
    return 0


def compare_rows(
    p: int, m: int, v: int | None, costs: Costs | None
) -> tuple[list[tuple[Schedule, SimResult]], dict[str, str], dict[str, str]]:
    """Simulate every registered schedule that can be built for ``(p, m, v)``.

    Returns the results, the schedules whose generator refused ``(p, m, v)`` (with the reason)
    and the generated schedules that failed validation (a bug, with the error)."""
    from .analysis.validate import validate

    done: list[tuple[Schedule, SimResult]] = []
    skipped: dict[str, str] = {}
    broken: dict[str, str] = {}
    for name in registry.names():
        info = registry.get(name)
        try:
            schedule = generate_schedule(name, p, m, v, costs)
        except ScheduleError as exc:
            skipped[info.name] = str(exc)
            continue
        try:
            lowered = validate(schedule)
        except ScheduleError as exc:
            broken[info.name] = str(exc)
            continue
        done.append((schedule, _simulate(schedule, costs, lowered)))
    return done, skipped, broken


def iteration_time_1f1b_units(schedule: Schedule, result: SimResult, costs: Costs | None) -> float:
    """The iteration makespan with each op's compute cost divided by the stages a rank holds per
    replica (a V or looped stage is 1/v of a 1F1B stage; a hop still carries a whole activation),
    so schedules with different v compare; ``--costs`` are read as one 1F1B stage's op times."""
    from dataclasses import replace

    from .analysis.simulate import Costs

    k = schedule.placement.stages_per_rank_per_replica
    if k == 1:
        return result.makespan
    base = costs or Costs.unit()

    def scale(x: Any) -> Any:
        return None if x is None else (tuple(v / k for v in x) if isinstance(x, tuple) else x / k)

    scaled = replace(base, t_f=scale(base.t_f), t_b=scale(base.t_b), t_w=scale(base.t_w), t_bw=scale(base.t_bw))
    return _simulate(schedule, scaled).makespan


def cmd_compare(args: argparse.Namespace) -> int:
    from .schedules.limits import MAX_OPS, OPS_PER_PAIR

    count = len(registry.names())  # every schedule is built: the op limit holds for all of them together
    ops = OPS_PER_PAIR * args.p * args.m * (args.v or 2) * count
    if ops > MAX_OPS:
        raise CliError(
            f"compare builds all {count} schedules at -p {args.p} -m {args.m} (v={args.v or 2}): about {ops:,} ops; "
            f"the limit is {MAX_OPS:,} (as for one schedule in simulate): give a smaller -p or -m"
        )
    costs = parse_costs(args.costs)
    done, skipped, broken = compare_rows(args.p, args.m, args.v, costs)
    if args.json:
        payload: dict[str, Any] = {
            "p": args.p,
            "m": args.m,
            "v": args.v,
            "costs": args.costs,
            "schedules": [result.to_json_dict() for _, result in done],
            "inapplicable": skipped,
            "invalid": broken,
        }
        print(json.dumps(payload))
        return 0
    rows = []
    times = [iteration_time_1f1b_units(schedule, result, costs) for schedule, result in done]
    fastest = min(times, default=None)
    for (schedule, result), time in zip(done, times, strict=True):
        worst = max(range(schedule.num_ranks), key=lambda r: result.peak_activations[r])
        rows.append(
            [
                schedule.name,
                schedule.chunks_per_rank,
                _num(time) + (" *" if time == fastest else ""),
                f"{result.bubble_rate:.4f}",
                f"{result.sync_bubble_rate:.4f}",
                _num(result.peak_activations[worst]),
                _num(result.peak_activations_1f1b_units[worst]),
                result.p2p_messages,
            ]
        )
    header = ["schedule", "v", "time", "bubble", "sync bubble", "peak act (stage)", "peak act (1F1B)", "p2p msgs"]
    print(f"p={args.p} m={args.m} v={args.v if args.v is not None else 'default'} costs={args.costs or 'unit'}")
    print("time: iteration makespan (every rank done), costs read as one 1F1B stage's (a stage of a rank holding")
    print("      k stages per model replica costs 1/k of them; a hop costs the same), * = fastest")
    print("peak activations: worst rank, in the schedule's own stage units and in 1F1B stage units")
    print(_fmt_table(header, rows))
    if skipped:
        print("\nnot applicable:")
        for name, reason in skipped.items():
            print(f"  {name}: {reason}")
    if broken:
        print("\nINVALID (generated but rejected by validate; a bug, please report):")
        for name, reason in broken.items():
            print(f"  {name}: {reason.splitlines()[0]}")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from .analysis.validate import check_collective_plan, validate
    from .schedules.collectives import CollectiveKind, policy_for

    wants = args.collectives or args.fsdp or args.distributed_optimizer or args.fsdp_max_unsharded is not None
    if args.fsdp_max_unsharded is not None and (not args.fsdp or args.fsdp_max_unsharded < 1):
        raise CliError(f"--fsdp-max-unsharded needs --fsdp and must be >= 1, got {args.fsdp_max_unsharded}")
    collectives = ""
    try:
        schedule = Schedule.load(args.file)
        lowered = validate(schedule)
        if wants:
            policy = policy_for(
                schedule,
                fsdp=args.fsdp,
                distributed_optimizer=args.distributed_optimizer,
                fsdp_max_unsharded=args.fsdp_max_unsharded,
            )
            plan = check_collective_plan(schedule, policy)
            counts = ", ".join(f"{plan.count(kind)} {kind}" for kind in CollectiveKind if plan.count(kind))
            collectives = f"; collectives checked ({counts or 'none'})"
    except ScheduleError as exc:
        message = str(exc)
        prefix = f"{args.file}:"
        print(f"INVALID {message if message.startswith(prefix) else f'{prefix} {message}'}", file=sys.stderr)
        return EXIT_INVALID
    num_ops = sum(len(row) for row in schedule.ops)
    print(
        f"OK {args.file}: {schedule.name}, {schedule.placement.style} placement, p={schedule.num_ranks} "
        f"m={schedule.num_microbatches} stages={schedule.num_stages}, {num_ops} ops, "
        f"{len(lowered.messages)} p2p messages, {len(lowered.local_handoffs)} local hand-offs, deadlock-free"
        f"{collectives}"
    )
    return 0


HTML_SCHEDULES = "1f1b,interleaved-1f1b,zb-h1,zb-auto,v-half,v-zb,bfs"


def cmd_draw_html(args: argparse.Namespace) -> int:
    """The schedule explorer: one self-contained HTML file with precomputed variants."""
    from .analysis import html
    from .analysis.peers import COST_MODELS

    if not str(args.output).lower().endswith((".html", ".htm")):
        raise CliError(f"with --html the output file must end in .html, got {args.output!r}")
    schedules = [args.name] if args.name else [x.strip() for x in args.html_schedules.split(",") if x.strip()]
    ps = [args.p] if args.p else _int_list(args.html_p)
    shapes = [(p, args.m) for p in ps] if args.m else [(p, f * p) for p in ps for f in _int_list(args.html_m_factors)]
    variants = html.build_variants(schedules, shapes, COST_MODELS)
    try:
        Path(args.output).write_text(html.render(variants))
    except OSError as exc:
        raise CliError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    bad = sum(1 for v in variants.values() if "error" in v)
    print(f"wrote {args.output}: {len(variants)} variants ({bad} not available)")
    return 0


def cmd_draw(args: argparse.Namespace) -> int:
    from .analysis.plot import draw

    if args.html:
        return cmd_draw_html(args)
    schedule = schedule_from_args(args)
    result = _simulate(schedule, parse_costs(args.costs))
    try:
        out = draw(result, schedule, args.output)
    except OSError as exc:
        raise CliError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    print(f"wrote {out}")
    return 0


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CliError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(x < 1 or x > 256 for x in values):
        raise CliError(f"expected integers in 1..256, got {text!r}")
    return values


PEERS_BEGIN, PEERS_END = "<!-- peers:begin -->", "<!-- peers:end -->"


def _write_peers_section(path: str, text: str) -> None:
    """Replace the peers section of ``path`` (between its markers), or append it. The command writes the
    file; ``analysis/peers.py`` only builds the text."""
    target = Path(path)
    old = target.read_text() if target.exists() else ""
    block = f"{PEERS_BEGIN}\n{text}\n{PEERS_END}"
    if PEERS_BEGIN in old and PEERS_END in old:
        head, _, rest = old.partition(PEERS_BEGIN)
        new = head + block + rest.partition(PEERS_END)[2]
    else:
        new = old.rstrip("\n") + "\n\n" + block + "\n"
    target.write_text(new)


def cmd_bench(args: argparse.Namespace) -> int:
    """Peer tables: torch.distributed.pipelining's schedules next to ours (imports torch); with --emulate,
    every schedule on real ranks with emulated compute (verification/emulate_bench.py)."""
    from .analysis import peers
    from .verification import emulate_bench

    if args.emulate:
        return emulate_bench.run(args)
    emulate_bench.settings_from(args)  # refuses the --emulate flags without --emulate
    args.p_list = args.p_list or "4,8,16,32"
    args.m_factors = args.m_factors or "1,2,3,4"
    command = "megatron-pp bench" + (f" -p {args.p_list}" if args.p_list != "4,8,16,32" else "")
    command += f" --m-factors {args.m_factors}" if args.m_factors != "1,2,3,4" else ""
    command += f" --write {args.write}" if args.write else ""
    command += f" --plots {args.plots}" if args.plots else ""
    text, rows = peers.report(_int_list(args.p_list), _int_list(args.m_factors), command)
    if args.plots:
        import os

        base = os.path.dirname(os.path.abspath(args.write)) if args.write else os.getcwd()
        for path in peers.plot_rows(rows, args.plots):
            text += f"\n\n![{path.stem}]({os.path.relpath(path.resolve(), base)})"
    if args.write:
        _write_peers_section(args.write, text)
        print(f"wrote the peers section of {args.write}")
    else:
        print(text)
    return 0


# ---- verify (added by the runtime) ---------------------------------------------------------
# >>> verify subcommand hook >>>
# The runtime (torch + megatron-core) provides `megatron_pp_ext.verification.verify_cli` with
#     add_verify_parser(subparsers) -> None
# which adds the `verify` parser and sets `func=<callable(args) -> int exit code>` as its default.
# It is imported only when the command line asks for `verify`, so no other subcommand imports torch.
def _add_verify_parser(subparsers: Any, load_runtime: bool) -> None:
    reason = "not requested"
    if load_runtime:
        try:
            from .verification.verify_cli import add_verify_parser
        except ImportError as exc:
            reason = str(exc)
        else:
            add_verify_parser(subparsers)
            return
    stub = subparsers.add_parser(
        "verify", help="run a schedule on real ranks and compare with a reference (needs the runtime)"
    )
    stub.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    stub.set_defaults(func=lambda args: _verify_unavailable(reason))


def _verify_unavailable(reason: str) -> int:
    print(
        f"{PROG}: error: verify needs the megatron_pp_ext runtime (torch + megatron-core), not installed: {reason}",
        file=sys.stderr,
    )
    return EXIT_USAGE


# <<< verify subcommand hook <<<


# >>> planner subcommands (megatron_pp_ext.planner) >>>
# `plan`, `grid`, `collect` and `launch-local` live in megatron_pp_ext/planner (plan_cli.py, slurm.py,
# collect.py, local.py); each module's add_parser(subparsers) adds its parser and sets `func`.
def _add_planner_parsers(subparsers: Any) -> None:
    from .planner import collect, local, plan_cli, slurm

    for module in (plan_cli, slurm, collect, local):
        module.add_parser(subparsers)


# <<< planner subcommands <<<


def _add_emulate_arguments(bench: argparse.ArgumentParser) -> None:
    from .verification.emulate_bench import add_arguments  # argument parsing only: no torch

    add_arguments(bench)


def build_parser(load_verify: bool = False) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="Pipeline-parallel schedules for megatron-core.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    sub.add_parser("list", help="registered schedules").set_defaults(func=cmd_list)

    sim = sub.add_parser("simulate", help="generate (or load), validate and simulate a schedule")
    add_source_args(sim)
    sim.add_argument("--json", action="store_true", help="print the result as JSON")
    sim.add_argument("--show", action="store_true", help="also print every rank's op list")
    sim.add_argument(
        "--overlap",
        type=float,
        default=0.0,
        metavar="F",
        help="overlap factor of the schedule's forward-and-backward pairs (dualpipev): a pair takes "
        "max + (1-F) x min; 0 (default) = one after the other",
    )
    sim.add_argument(
        "--iterations",
        type=argtypes.positive_int,
        default=1,
        metavar="N",
        help="simulate N back-to-back iterations and report the time per iteration in steady state",
    )
    sim.add_argument(
        "--post-validation",
        action="store_true",
        help="no global synchronisation before the optimizer step (the zero-bubble paper's optimizer "
        "post-validation): a rank begins its next iteration once its own ops and its inputs allow",
    )
    sim.add_argument(
        "--step-time",
        type=_step_times,
        default=0.0,
        metavar="T[,T...]",
        help="optimizer step time between iterations: one for every rank or one per rank (default 0)",
    )
    dp = sim.add_argument_group("data parallelism (a collective stream per rank; --costs then read as ms)")
    dp.add_argument("--dp", type=int, default=None, metavar="N", help="data-parallel size (ranks per stage), >= 2")
    dp.add_argument("--dp-bandwidth", metavar="GBPS", help="data-parallel bus bandwidth per rank, GB/s")
    dp.add_argument(
        "--param-bytes",
        metavar="BYTES",
        help="parameter (and gradient) bytes of one rank's 1/p of the model, e.g. 300M; split evenly over its chunks",
    )
    dp.add_argument("--fsdp", action="store_true", help="fully sharded: gather each chunk before use (FSDP)")
    dp.add_argument(
        "--fsdp-max-unsharded",
        type=int,
        default=None,
        metavar="K",
        help="chunks gathered at once (default: the schedule's)",
    )
    dp.add_argument(
        "--distributed-optimizer", action="store_true", help="reduce-scatter gradients, gather parameters per chunk"
    )
    sim.set_defaults(func=cmd_simulate)

    cmp_ = sub.add_parser("compare", help="every applicable schedule side by side")
    cmp_.add_argument("-p", type=argtypes.positive_int, required=True, help="pipeline-parallel size (ranks)")
    cmp_.add_argument("-m", type=argtypes.positive_int, required=True, help="micro-batches per iteration")
    cmp_.add_argument("-v", type=argtypes.positive_int, default=None, help="virtual stages (chunks) per rank")
    cmp_.add_argument("--costs", metavar="F,B,W,COMM", help="per-stage op times and per-hop comm time")
    cmp_.add_argument("--json", action="store_true", help="print the comparison as JSON")
    cmp_.set_defaults(func=cmd_compare)

    val = sub.add_parser("validate", help="check a schedule CSV (dependencies, placement, deadlock freedom)")
    val.add_argument("file", help="schedule CSV")
    val.add_argument(
        "--collectives", action="store_true", help="also derive and check the data-parallel gradient reductions"
    )
    val.add_argument("--fsdp", action="store_true", help="... and FSDP gathers / reshards (implies --collectives)")
    val.add_argument("--fsdp-max-unsharded", type=int, default=None, metavar="K", help="FSDP chunks gathered at once")
    val.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="... and per-chunk parameter gathers (implies --collectives)",
    )
    val.set_defaults(func=cmd_validate)

    drw = sub.add_parser("draw", help="Gantt chart of a simulated schedule")
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

    bench = sub.add_parser("bench", help="torch.distributed.pipelining's schedules vs ours in the simulator")
    bench.add_argument("-p", dest="p_list", default=None, help="pipeline sizes, comma-separated (default 4,8,16,32)")
    bench.add_argument("--m-factors", default=None, help="m = factor * p for each factor (default 1,2,3,4)")
    bench.add_argument("--write", metavar="RESULTS.md", help="replace the peers section of this markdown file")
    bench.add_argument("--plots", metavar="DIR", help="also draw bubble-vs-m and peak-memory plots (matplotlib)")
    _add_emulate_arguments(bench)
    bench.set_defaults(func=cmd_bench)

    _add_verify_parser(sub, load_verify)
    _add_planner_parsers(sub)  # planner subcommands (see the block above)
    return parser


def _wants_verify(argv: Sequence[str]) -> bool:
    positional = [a for a in argv if not a.startswith("-")]
    return bool(positional) and positional[0] == "verify"


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(load_verify=_wants_verify(args_list))
    args = parser.parse_args(args_list)
    try:
        return int(args.func(args))
    except (ScheduleError, ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:  # e.g. `megatron-pp simulate ... | head`: the reader left, not an error
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
