"""``megatron-pp simulate``: generate (or load), validate and simulate a schedule, and print what it does."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from .. import argtypes
from ..argtypes import fraction
from ..schedule_args import CliError, add_source_args, dp_options, parse_cli_costs, schedule_from_args
from ..schedules.layer_split import add_split_arguments
from ..schedules.schedule import Schedule
from .formatting import building_block_of, data_parallel_summary, num, summary
from .support import step_times

if TYPE_CHECKING:
    from ..analysis.moe_comm import MoeComm
    from ..analysis.simulate import SimResult
    from ..schedules.costs import Costs
    from ..schedules.lowering import LoweredSchedule


def simulated(schedule: Schedule, costs: Costs | None, lowered: LoweredSchedule | None = None) -> SimResult:
    """The simulated run of ``schedule`` (validated here unless ``lowered`` is given)."""
    from ..analysis.schedule_check import validate
    from ..analysis.simulate import simulate

    if lowered is None:
        lowered = validate(schedule)
    return simulate(schedule, costs, lowered=lowered)


def cmd_simulate(args: argparse.Namespace) -> int:
    from ..analysis.schedule_check import validate
    from ..analysis.simulate import simulate

    schedule = schedule_from_args(args)
    options = dp_options(args, schedule)
    if isinstance(args.step_time, list) and len(args.step_time) != schedule.num_ranks:
        raise CliError(
            f"--step-time lists {len(args.step_time)} times: give one, or one per rank ({schedule.num_ranks})"
        )
    repeat = {"iterations": args.iterations, "post_validation": args.post_validation, "step_time": args.step_time}
    if options and (args.iterations > 1 or args.post_validation or args.step_time != 0.0):
        raise CliError("--iterations / --post-validation / --step-time are simulated without --dp only")
    w_retained = 1.0 if args.w_memory is None else args.w_memory
    costs = uneven_costs(args, schedule)
    if args.host_costs is not None:  # the runtime's host time per op and per exchange, as busy time
        from ..analysis.host_costs import with_host_costs
        from ..schedules.costs import Costs

        costs = with_host_costs(costs or Costs.unit(), schedule.placement, *args.host_costs)
    moe = moe_comm(args, schedule, bool(options))
    if moe is not None and moe.overlap:  # the order and pairs the executor overlaps (dualpipev keeps its own)
        from ..analysis.overlap_order import overlap_order

        schedule = overlap_order(schedule)
    if options:
        result = simulate(
            schedule, costs, lowered=validate(schedule), w_retained_fraction=w_retained, moe=moe, **options
        )
    else:
        result = simulate(
            schedule,
            costs,
            lowered=validate(schedule),
            overlap=args.overlap,
            w_retained_fraction=w_retained,
            moe=moe,
            **repeat,
        )
    if args.json:
        data = result.to_json_dict()
        block = building_block_of(schedule)
        if block is not None:
            data["building_block"] = block
        print(json.dumps(data))
        return 0
    print(summary(schedule, result))
    if moe is not None:
        print(moe_summary(schedule, moe))
    if result.data_parallel is not None:
        print()
        print(data_parallel_summary(result))
    if result.iterations is not None:
        it = result.iterations
        sync = "optimizer post-validation (no step synchronisation)" if it.post_validation else "synchronous step"
        note = "" if it.count > 1 else " (one iteration: give --iterations >= 2 for the steady state)"
        print()
        print(f"iterations      {it.count} back to back, {sync}; per iteration {num(it.time)}{note}")
    if args.show:
        print()
        print(schedule.table())
    return 0


def moe_comm(args: argparse.Namespace, schedule: Schedule, data_parallel: bool) -> MoeComm | None:
    """The all-to-all model of ``--moe-a2a``, ``--moe-layers`` and ``--overlap-moe-expert-parallel-comm``
    (None without ``--moe-a2a``); CliError names the flag."""
    from ..analysis.moe_comm import MoeComm

    if args.moe_a2a is None:
        given = [
            f
            for f, v in (("--moe-layers", args.moe_layers), ("--overlap-moe-expert-parallel-comm", args.overlap_moe))
            if v not in (None, False)
        ]
        if given:
            raise CliError(f"{given[0]}: only with --moe-a2a (the time of one all-to-all)")
        return None
    if args.overlap_moe and args.overlap:
        raise CliError("--overlap-moe-expert-parallel-comm: not with --overlap (two models of the same pairs)")
    if args.overlap_moe and data_parallel:
        raise CliError("--overlap-moe-expert-parallel-comm: simulated without --dp only")
    layers = 1 if args.moe_layers is None else args.moe_layers
    n = schedule.num_stages
    if isinstance(layers, tuple) and len(layers) != n:
        raise CliError(f"--moe-layers lists {len(layers)} stages: give one number, or one per stage ({n})")
    return MoeComm(args.moe_a2a, layers, bool(args.overlap_moe))


def moe_summary(schedule: Schedule, moe: MoeComm) -> str:
    """One line: the all-to-all model and how many pairs hide them."""
    pairs = sum(len(row) for row in schedule.overlap_pairs)
    layers = moe.layers if isinstance(moe.layers, int) else ",".join(map(str, moe.layers))
    if not moe.overlap:
        how = "added to every F, B and BW (no overlap)"
    elif pairs:
        how = f"hidden in {pairs} overlapped F&B pairs (two streams), added to the other ops"
    else:
        how = "added to every F, B and BW: this schedule carries no overlap pairs"
    return f"all-to-all     {num(moe.a2a)} each, {layers} MoE layers per stage, {how}"


def uneven_costs(args: argparse.Namespace, schedule: Schedule) -> Costs | None:
    """``--costs`` (one stage of an even split), per stage in proportion to its layers when megatron's uneven-split
    flags are given (:func:`~megatron_pp_ext.schedules.split_costs.stage_costs_from_layout`)."""
    from ..schedules.costs import Costs
    from ..schedules.layer_split import SPLIT_FLAGS, LayerSplitError, split_from_args
    from ..schedules.split_costs import stage_costs_from_layout

    costs = parse_cli_costs(args.costs)
    given = [flag for attr, flag in SPLIT_FLAGS if getattr(args, attr, None) not in (None, False)]
    if not given:
        return costs
    placement = schedule.placement
    if args.num_layers is None:
        raise CliError(f"{given[0]} needs --num-layers (the model's transformer layers)")
    try:
        return stage_costs_from_layout(costs or Costs.unit(), placement, args.num_layers, split_from_args(args))
    except (ValueError, LayerSplitError) as exc:
        where = f"{schedule.name}: {placement.style} placement, {placement.stages_per_replica} model stages"
        raise CliError(f"{given[0]}: {exc} ({where})") from None


def add_parser(subparsers: Any) -> None:
    """Adds ``simulate`` to ``megatron-pp``'s sub-commands (its parser, with ``func`` set). Long because it
    lists the command's flags, one call each."""
    sim = subparsers.add_parser("simulate", help="generate (or load), validate and simulate a schedule")
    add_source_args(sim)
    sim.add_argument("--json", action="store_true", help="print the result as JSON")
    sim.add_argument("--show", action="store_true", help="also print every rank's op list")
    sim.add_argument(
        "--overlap",
        type=fraction,
        default=0.0,
        metavar="F",
        help="overlap factor of the schedule's forward-and-backward pairs (dualpipev): a pair takes "
        "max + (1-F) x min; 0 (default) = one after the other",
    )
    sim.add_argument(
        "--host-costs",
        type=argtypes.host_costs,
        default=None,
        metavar="OP[,EXCHANGE]",
        help="host time every op pays (the runtime's bookkeeping) and a sender pays per exchange to another rank "
        "(posting it), in the unit of --costs, charged as busy time; `bench --real-peers` measures both",
    )
    moe = sim.add_argument_group("MoE expert-parallel all-to-alls (docs/moe.md)")
    moe.add_argument(
        "--moe-a2a",
        type=argtypes.a2a_time,
        default=None,
        metavar="T",
        help="time of one all-to-all (dispatch or combine) of one MoE layer, in the unit of --costs",
    )
    moe.add_argument(
        "--moe-layers",
        type=argtypes.moe_layers,
        default=None,
        metavar="N[,N...]",
        help="MoE layers of each stage: one number, or one per global stage (default 1)",
    )
    moe.add_argument(
        "--overlap-moe-expert-parallel-comm",
        dest="overlap_moe",
        action="store_true",
        help="the schedule's F&B overlap pairs run on two streams, each side's all-to-alls under the other's "
        "compute (megatron's flag); without it every all-to-all adds to its op",
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
        type=step_times,
        default=0.0,
        metavar="T[,T...]",
        help="optimizer step time between iterations: one for every rank or one per rank (default 0)",
    )
    uneven = sim.add_argument_group(
        "uneven stages (megatron's flags, per model stage of the placement: docs/uneven.md); --costs are then those "
        "of one stage of the even split, scaled by each stage's layers"
    )
    uneven.add_argument("--num-layers", type=argtypes.positive_int, default=None, help="transformer layers")
    add_split_arguments(uneven)
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
