"""How a command line names a schedule: the source flags (name, -p, -m, -v, costs, memory limit,
block file, ...), the data-parallel flags of the simulator, and building the schedule from them.

Shared by ``megatron-pp`` (:mod:`.cli`) and the commands the runtime adds (``verify``), so that neither
imports the other's internals."""

from __future__ import annotations

import argparse
import re
import sys
from typing import TYPE_CHECKING, Any

from . import argtypes
from .schedules import registry, values
from .schedules.schedule import Schedule

if TYPE_CHECKING:
    from .schedules.costs import Costs

__all__ = [
    "PROG",
    "CliError",
    "add_source_args",
    "dp_options",
    "generate_schedule",
    "parse_bytes",
    "parse_cli_costs",
    "parse_cli_memory_limit",
    "schedule_from_args",
]

PROG = "megatron-pp"


class CliError(ValueError):
    """Bad command-line input; printed as ``megatron-pp: error: ...`` with exit code 2."""


# ---- argument parsing helpers --------------------------------------------------------------
def parse_cli_memory_limit(text: str | None, p: int) -> int | float | None:
    """``megatron-pp``'s ``--memory-limit`` (:func:`.schedules.values.parse_memory_limit`, resolved for ``p``):
    ``"12"`` -> 12, ``"2p"`` -> 2*p, ``"p"`` -> p, ``"1.5p"`` -> 1.5*p (activations; integral values as int)."""
    if text is None:
        return None
    try:
        return values.parse_memory_limit(text).resolve(p)
    except ValueError as exc:
        raise CliError(f"argument --memory-limit: {exc}") from None


def parse_cli_costs(text: str | None) -> Costs | None:
    """``megatron-pp``'s ``--costs`` (:func:`.schedules.values.parse_costs`) as :class:`Costs`; a bad value
    is a :class:`CliError` naming the flag."""
    if text is None:
        return None
    from .schedules.costs import Costs

    try:
        return Costs.parse(text)
    except ValueError as exc:  # the shared parser's line, with the flag it came from
        raise CliError(f"--costs: {exc}") from None


def generate_schedule(
    name: str,
    p: int,
    m: int,
    v: int | None = None,
    costs: Costs | None = None,
    memory_limit: object = None,
    block_file: str | None = None,
    microbatch_group_size: int | None = None,
    unit_size: int | str | None = None,
    objective: str | None = None,
    w_memory: float | None = None,
) -> Schedule:
    """Generate a registered schedule. ``costs`` and ``w_memory`` go only to the schedules that
    declare them (for the others they only shape the simulation); ``v``, ``memory_limit``,
    ``block_file`` and ``objective`` go to all, and the declarations refuse what a schedule cannot
    honour."""
    info = registry.get(name)
    kwargs: dict[str, object] = {"v": v, "memory_limit": memory_limit, "block_file": block_file}
    if microbatch_group_size is not None:
        kwargs["microbatch_group_size"] = microbatch_group_size
    if unit_size is not None:
        kwargs["unit_size"] = unit_size
    if objective is not None:
        kwargs["objective"] = objective
    if costs is not None and info.takes("costs"):
        kwargs["costs"] = costs
    if w_memory is not None and w_memory != 1.0 and info.takes("w_memory"):
        kwargs["w_memory"] = w_memory
    return info.build(p, m, **kwargs)


def add_source_args(parser: argparse.ArgumentParser, file_option: bool = True) -> None:
    parser.add_argument("name", nargs="?", help="registered schedule name (see `megatron-pp list`)")
    parser.add_argument("-p", type=argtypes.positive_int, help="pipeline-parallel size (ranks)")
    parser.add_argument("-m", type=argtypes.positive_int, help="micro-batches per iteration")
    parser.add_argument("-v", type=argtypes.positive_int, default=None, help="virtual stages (chunks) per rank")
    parser.add_argument("--costs", metavar="F,B,W,COMM", help="per-stage op times and per-hop comm time")
    parser.add_argument(
        "--memory-limit", metavar="N|Np", help="activation memory limit, a number or a multiple of p (e.g. 2p)"
    )
    parser.add_argument("--block-file", metavar="JSON", help="building block of v-block (default: the V-Half block)")
    parser.add_argument(
        "--microbatch-group-size",
        type=argtypes.positive_int,
        default=None,
        metavar="G",
        help="micro-batches per group (interleaved-1f1b; bfs: per breadth-first group, default m)",
    )
    parser.add_argument(
        "--pipeline-unit-size",
        dest="unit_size",
        type=argtypes.unit_size,
        default=None,
        metavar="N|auto",
        help="zeropp: micro-batches per scheduling unit (default m); 'auto' picks it with the simulator "
        "(and --memory-limit, in 1F1B stage activations M_a; the data-parallel flags when given)",
    )
    parser.add_argument(
        "--objective",
        choices=("span", "makespan"),
        default=None,
        help="zb-auto: minimise the iteration time with optimizer post-validation (span: the longest per-rank "
        "span bounds it) or with a synchronous step (makespan); default span with --post-validation, else makespan",
    )
    parser.add_argument(
        "--w-memory",
        type=argtypes.positive_fraction,
        default=None,
        metavar="FRACTION",
        help="share of an activation a pending W keeps after its B, in (0, 1] (zero-bubble paper Table 1: "
        "M_W/M_B); the memory count and zb-auto's limit use it; default 1 (the whole activation until W)",
    )
    if file_option:
        parser.add_argument("--schedule-file", metavar="CSV", help="load the schedule from a CSV file instead")


def schedule_from_args(args: argparse.Namespace) -> Schedule:
    if getattr(args, "schedule_file", None):
        if args.name:
            raise CliError(f"give either a schedule name ({args.name!r}) or --schedule-file, not both")
        schedule = Schedule.load(args.schedule_file)
        for flag, given, actual in (("-p", args.p, schedule.num_ranks), ("-m", args.m, schedule.num_microbatches)):
            if given is not None and given != actual:
                raise CliError(f"{flag} {given} disagrees with {args.schedule_file} ({actual})")
        return schedule
    if not args.name:
        raise CliError("give a schedule name (see `megatron-pp list`) or --schedule-file")
    if args.p is None or args.m is None:
        raise CliError(f"schedule {args.name!r} needs -p (ranks) and -m (micro-batches)")
    if getattr(args, "unit_size", None) == "auto" and registry.get(args.name).name == "zeropp":
        return auto_unit_size(args)
    objective = getattr(args, "objective", None)
    if objective is None and getattr(args, "post_validation", False) and registry.get(args.name).takes("objective"):
        objective = "span"
    return generate_schedule(
        args.name,
        args.p,
        args.m,
        args.v,
        parse_cli_costs(args.costs),
        parse_cli_memory_limit(args.memory_limit, args.p),
        getattr(args, "block_file", None),
        getattr(args, "microbatch_group_size", None),
        getattr(args, "unit_size", None),
        objective,
        getattr(args, "w_memory", None),
    )


def auto_unit_size(args: argparse.Namespace) -> Schedule:
    """``zeropp --pipeline-unit-size auto``: built by the registry, whose chooser picks U with the simulator
    (timed with the data-parallel flags when given); the table goes to stderr."""
    from .analysis.zeropp_auto import UnitChoice, UnitSizeContext, unit_size_context

    costs = parse_cli_costs(args.costs)
    context: dict[str, Any] = {}
    if getattr(args, "dp_bandwidth", None) is not None:  # simulate: collectives timed on the DP stream
        provisional = generate_schedule("zeropp", args.p, args.m, args.v, costs, unit_size=args.m)
        options = dp_options(args, provisional)
        if options:
            context = {
                "dp": options["dp"],
                "dp_bandwidth": options["dp_bandwidth"],
                "param_bytes": options["param_bytes"],
                "fsdp": options["collectives"].fsdp_max_unsharded is not None,
            }

    def report(choice: UnitChoice) -> None:
        print(choice.table(), file=sys.stderr)
        print(f"zeropp: chose --pipeline-unit-size {choice.best.unit_size}", file=sys.stderr)

    with unit_size_context(UnitSizeContext(**context, report=report)):
        return generate_schedule(
            "zeropp", args.p, args.m, args.v, costs, parse_cli_memory_limit(args.memory_limit, args.p), unit_size="auto"
        )


_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d*)?(?:e\d+)?|\.\d+)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)
_BYTE_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
#: With --dp, --costs times are milliseconds: a collective of B bytes at X GB/s takes B / (X * 1e6) ms.
BYTES_PER_MS_PER_GBPS = 1e6


def parse_bytes(text: str, flag: str) -> float:
    """``"300M"`` -> 3e8, ``"1.5G"`` -> 1.5e9, ``"4096"`` -> 4096 (decimal units; a trailing B is ignored)."""
    match = _BYTES_RE.match(text)
    if match is None or float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()] <= 0:
        raise CliError(f"{flag} must be a number of bytes > 0, optionally with K, M, G or T (e.g. 300M), got {text!r}")
    return float(match.group(1)) * _BYTE_UNITS[match.group(2).lower()]


def dp_options(args: argparse.Namespace, schedule: Schedule) -> dict[str, Any]:
    """``simulate()`` keywords for the data-parallel flags (empty without --dp), or CliError."""
    from .schedules.collectives import policy_for

    given = [
        flag
        for flag, value in (
            ("--dp-bandwidth", args.dp_bandwidth),
            ("--param-bytes", args.param_bytes),
            ("--fsdp", args.fsdp or None),
            ("--fsdp-max-unsharded", args.fsdp_max_unsharded),
            ("--distributed-optimizer", args.distributed_optimizer or None),
        )
        if value is not None
    ]
    if args.dp is None:
        if given:
            raise CliError(f"{given[0]} describes data parallelism: give --dp N (data-parallel size) too")
        return {}
    if args.dp < 2:
        raise CliError(f"--dp must be an integer >= 2 (data-parallel ranks per pipeline stage), got {args.dp}")
    missing = [
        flag
        for flag, value in (("--dp-bandwidth", args.dp_bandwidth), ("--param-bytes", args.param_bytes))
        if value is None
    ]
    if missing:
        raise CliError(f"--dp {args.dp} needs {' and '.join(missing)} (collective times come from bytes and bandwidth)")
    try:
        gbps = float(args.dp_bandwidth)
    except ValueError:
        gbps = -1.0
    if not gbps > 0 or gbps == float("inf"):
        raise CliError(f"--dp-bandwidth must be a number of GB/s > 0, got {args.dp_bandwidth!r}")
    if args.fsdp_max_unsharded is not None and not args.fsdp:
        raise CliError("--fsdp-max-unsharded needs --fsdp")
    if args.fsdp_max_unsharded is not None and args.fsdp_max_unsharded < 1:
        raise CliError(f"--fsdp-max-unsharded must be >= 1 (chunks gathered at once), got {args.fsdp_max_unsharded}")
    policy = policy_for(
        schedule,
        fsdp=args.fsdp,
        distributed_optimizer=args.distributed_optimizer,
        fsdp_max_unsharded=args.fsdp_max_unsharded,
    )
    return {
        "collectives": policy,
        "dp": args.dp,
        "dp_bandwidth": gbps * BYTES_PER_MS_PER_GBPS,
        # one rank's share of the model (1/p of it) split evenly across the chunks holding it
        "param_bytes": parse_bytes(args.param_bytes, "--param-bytes") / schedule.placement.stages_per_rank_per_replica,
    }
