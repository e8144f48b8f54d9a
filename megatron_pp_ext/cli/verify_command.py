"""``megatron-pp verify``: check a schedule on real gloo ranks against the unpartitioned reference."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from ..argtypes import nonnegative_float, positive_float, positive_int
from ..verification.moe_check import moe_problem


def add_verify_parser(subparsers: Any) -> None:
    """Add ``megatron-pp verify``'s parser and flags to ``subparsers``.

    Long because it lists the command's flags, one ``add_argument`` each, in the order ``--help`` shows them.
    """
    from ..schedule_args import add_source_args as _add_source_args
    from ..schedules.layer_split import add_split_arguments
    from ..verification.tiny_gpt import RECOMPUTE

    parser = subparsers.add_parser(
        "verify",
        help="run a schedule on real gloo ranks (tiny GPTModel) and compare loss and every gradient with a "
        "single-process reference",
        description="Spawns P gloo ranks on this machine, builds a tiny megatron-core GPTModel split by the "
        "schedule's placement, trains a few iterations with Adam and compares loss and every parameter "
        "gradient with the same model unpartitioned (same seed, same data).",
    )
    _add_source_args(parser)
    parser.add_argument("--iterations", type=positive_int, default=3, help="training iterations (default 3)")
    parser.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size (default 1)")
    parser.add_argument(
        "--layers-per-stage", type=positive_int, default=1, help="transformer layers per stage (default 1)"
    )
    parser.add_argument(
        "--recompute-granularity",
        choices=RECOMPUTE,
        default=None,
        help="megatron's activation recomputation in every run: full (each layer) or selective (core attention)",
    )
    parser.add_argument(
        "--num-layers",
        type=positive_int,
        default=None,
        help="transformer layers of the model (default: model stages x --layers-per-stage)",
    )
    add_split_arguments(parser)  # megatron's uneven-split flags, per model stage of the placement (docs/uneven.md)
    parser.add_argument(
        "--hybrid-pattern",
        default=None,
        metavar="PATTERN",
        help="verify a megatron-core HybridModel of this layer pattern instead of a GPTModel: '*' attention, "
        "'-' MLP, 'E' MoE, '|' between model stages (one segment per stage of the schedule's placement, "
        "stage s gets segment s; e.g. '*-|*-|*-|*-' for v-zb at p=2); replaces --layers-per-stage",
    )
    parser.add_argument(
        "--mtp-num-layers",
        type=positive_int,
        default=None,
        help="megatron's multi-token prediction layers, with the loss on the model's last stage (as 'm' before 'L' "
        "in --pipeline-model-parallel-layout); the model then uses rotary position embeddings",
    )
    parser.add_argument("--untied-embeddings", action="store_true", help="separate input and output embeddings")
    parser.add_argument("--no-ddp", action="store_true", help="plain autograd gradients instead of megatron DDP")
    parser.add_argument("--sequence-parallel", action="store_true", help="megatron sequence parallelism (tp > 1)")
    parser.add_argument(
        "--dp", type=int, default=1, help="data-parallel replicas of the pipeline (P x TP x DP ranks; default 1)"
    )
    parser.add_argument(
        "--num-experts",
        type=positive_int,
        default=None,
        help="a MoE model: every layer's MLP is megatron's MoE layer with this many experts (default: dense)",
    )
    parser.add_argument("--moe-topk", type=positive_int, default=2, help="with --num-experts: experts per token (2)")
    parser.add_argument(
        "--moe-aux-loss-coeff",
        type=nonnegative_float,
        default=1e-2,
        help="with --num-experts: the router's load-balancing loss coefficient (default 0.01)",
    )
    parser.add_argument(
        "--moe-dispatcher",
        choices=("alltoall", "allgather"),
        default="alltoall",
        help="with --num-experts: megatron's token dispatcher (default alltoall)",
    )
    parser.add_argument(
        "--ep",
        type=positive_int,
        default=1,
        help="with --num-experts: expert-parallel size, carved out of the --dp ranks as megatron does (default 1)",
    )
    parser.add_argument(
        "--overlap-moe",
        action="store_true",
        help="with --num-experts: run every F, B and overlap pair through megatron's combined forward-backward "
        "step, the schedule's overlap pairs hiding each other's expert-parallel all-to-alls",
    )
    parser.add_argument(
        "--distributed-optimizer",
        action="store_true",
        help="megatron's distributed optimizer (gradient reduce-scatter, parameter all-gather); needs megatron DDP",
    )
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help="fully sharded data parallelism per model chunk: the schedule's derived unshard/reshard "
        "collectives gather and free each chunk's parameters (needs --untied-embeddings for now)",
    )
    parser.add_argument(
        "--fsdp-max-unsharded",
        type=int,
        default=None,
        help="with --fsdp: model chunks a rank may hold gathered at once (default: the schedule's declared "
        "limit, e.g. 2 for zeropp, else 1)",
    )
    parser.add_argument(
        "--tolerance",
        type=nonnegative_float,
        default=None,
        help="a fixed bound on the max relative gradient difference to megatron's fp32 reference, instead of the "
        "derived verdict (default: ours must be as close to a float64 run as megatron's own fp32 run is, within a "
        "factor 4; docs/verification.md)",
    )
    parser.add_argument("--timeout", type=positive_float, default=60.0, help="seconds before a stuck send/recv fails")
    parser.add_argument(
        "--post-validation",
        action="store_true",
        help="also train with optimizer post-validation (--pipeline-post-validation) and megatron's optimizer, "
        "and check the weights are bitwise those of megatron's synchronous step (docs/post_validation.md)",
    )
    parser.add_argument(
        "--post-validation-late",
        action="store_true",
        help="with --post-validation: validate after the next iteration's forward-backward instead of before it, "
        "re-running that iteration when validation changed weights",
    )
    parser.add_argument(
        "--clip-grad",
        type=nonnegative_float,
        default=0.0,
        help="with --post-validation: megatron's gradient clipping threshold (default 0: off)",
    )
    parser.add_argument(
        "--inject-inf",
        action="append",
        default=[],
        metavar="ITER:STAGE",
        type=_iteration_stage,
        help="with --post-validation: make one gradient inf on pipeline stage STAGE in iteration ITER (0-based; "
        "repeatable), to exercise the found-inf skip and the rollback",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=run_verify)


def hybrid_refusal(pattern: str, schedule: Any, tp: int = 1, mtp: bool = False) -> str | None:
    """Why ``--hybrid-pattern`` cannot be verified with ``schedule`` (one line), or None. Pure: before any rank.
    ``mtp``: ``--mtp-num-layers`` given too (it verifies a GPTModel)."""
    from ..integration.hybrid import LOCAL_SYMBOLS
    from ..runtime.hybrid_pattern import HybridPatternError, check_runnable, hybrid_layer_split

    flag = "--hybrid-pattern"
    if mtp:
        return f"{flag}: --mtp-num-layers verifies a GPTModel, not with a HybridModel"
    if "/" in pattern:
        return f"{flag} {pattern!r}: verify builds its HybridModel without MTP ('/'); verify MTP with --mtp-num-layers"
    try:
        hybrid_layer_split(pattern, schedule.placement, schedule.name, flag)
        check_runnable(pattern, LOCAL_SYMBOLS, "by verify (megatron-core's local layers)", flag)
    except HybridPatternError as exc:
        return str(exc)
    if tp > 1 and "E" in pattern:
        return f"{flag} {pattern!r}: MoE layers ('E') are verified with --tp 1 only"
    return None


def _iteration_stage(text: str) -> tuple[int, int]:
    parts = text.split(":")
    if len(parts) != 2 or not all(x.strip().isdigit() for x in parts):
        raise argparse.ArgumentTypeError(f"expected ITER:STAGE (two integers >= 0), got {text!r}")
    return int(parts[0]), int(parts[1])


def run_verify(args: argparse.Namespace) -> int:
    """``megatron-pp verify``: refuse a request that cannot run (exit 2) before any rank starts, then run it."""
    from ..schedule_args import PROG
    from ..schedule_args import schedule_from_args as _schedule_from_args

    problem = _flag_problem(args)
    if problem is not None:
        print(f"{PROG}: {problem}", file=sys.stderr)
        return 2
    schedule = _schedule_from_args(args)
    problem = _schedule_problem(args, schedule)
    if problem is not None:
        print(f"{PROG}: {problem}", file=sys.stderr)
        return 2
    if args.fsdp_max_unsharded is None:
        from ..schedules.collectives import declared_fsdp_limit

        args.fsdp_max_unsharded = declared_fsdp_limit(schedule) or 1
    split = _layer_split(args, schedule)
    if isinstance(split, str):
        print(f"{PROG}: error: {split}", file=sys.stderr)
        return 2
    from ..verification.tiny_gpt import (
        TinyGPTSpec,  # torch and megatron-core: imported once the request is known to fit
    )

    model = TinyGPTSpec(
        num_layers=args.num_layers or schedule.placement.stages_per_replica * args.layers_per_stage,
        tied_embeddings=not args.untied_embeddings,
        recompute=args.recompute_granularity,
        num_experts=args.num_experts,
        moe_topk=args.moe_topk,
        moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_dispatcher=args.moe_dispatcher,
        split=split,
        hybrid_pattern=args.hybrid_pattern,
        mtp_num_layers=args.mtp_num_layers,
    )
    status = _verify_and_report(args, schedule, model)
    if status == 0 and args.post_validation:
        return _run_post_validation(args, schedule, model)
    return status


def _flag_problem(args: argparse.Namespace) -> str | None:
    """One line for flags that do not go together (before the schedule is built), else None."""
    if args.dp < 1:
        return f"--dp must be an integer >= 1, got {args.dp}"
    if args.distributed_optimizer and args.no_ddp:
        return "--distributed-optimizer needs megatron DDP (drop --no-ddp)"
    if args.fsdp and (args.distributed_optimizer or args.no_ddp or not args.untied_embeddings):
        return (
            "--fsdp shards parameters, gradients and optimizer state itself and supports untied "
            "embeddings only for now: use it with --untied-embeddings, without --distributed-optimizer / --no-ddp"
        )
    if args.fsdp_max_unsharded is not None and not args.fsdp:
        return "--fsdp-max-unsharded is an FSDP setting: add --fsdp (or drop it)"
    if args.fsdp_max_unsharded is not None and args.fsdp_max_unsharded < 1:
        return f"--fsdp-max-unsharded must be >= 1, got {args.fsdp_max_unsharded}"
    if (args.clip_grad or args.inject_inf or args.post_validation_late) and not args.post_validation:
        flags = "--clip-grad, --inject-inf and --post-validation-late"
        return f"{flags} go with --post-validation"
    if args.post_validation and (args.fsdp or args.no_ddp):
        return "--post-validation wraps megatron's optimizer: use it with megatron DDP, without --fsdp"
    return _moe_problem(args) or None


def _schedule_problem(args: argparse.Namespace, schedule: Any) -> str | None:
    """One line for a request the built schedule cannot run (hybrid pattern, local ranks, --inject-inf)."""
    from ..verification.rank_budget import check_local_ranks

    if args.hybrid_pattern is not None:
        refusal = hybrid_refusal(args.hybrid_pattern, schedule, args.tp, mtp=args.mtp_num_layers is not None)
        if refusal is not None:
            return refusal
    too_many = check_local_ranks(
        schedule.num_ranks * args.tp * args.dp, f"-p {schedule.num_ranks} x --tp {args.tp} x --dp {args.dp}"
    )
    if too_many is not None:
        return too_many
    bad = [f"{i}:{s}" for i, s in args.inject_inf if i >= args.iterations or s >= schedule.num_ranks]
    if bad:
        return (
            f"--inject-inf {bad[0]}: ITER must be < --iterations ({args.iterations}) and STAGE < {schedule.num_ranks}"
        )
    return None


def _verify_and_report(args: argparse.Namespace, schedule: Any, model: Any) -> int:
    """Run the verification on ranks and print its report; 0 when it passed, else 1."""
    from ..schedule_args import PROG
    from ..verification.rank_pool import VerifyRunError
    from ..verification.verify import verify_schedule
    from ..verification.verify_report import report_lines

    try:
        report = verify_schedule(
            schedule,
            model=model,
            tp=args.tp,
            iterations=args.iterations,
            use_ddp=not args.no_ddp,
            sequence_parallel=args.sequence_parallel,
            timeout_s=args.timeout,
            tol=args.tolerance,
            dp=args.dp,
            ep=args.ep,
            overlap_moe=args.overlap_moe,
            distributed_optimizer=args.distributed_optimizer,
            fsdp=args.fsdp,
            fsdp_max_unsharded=args.fsdp_max_unsharded,
            progress=lambda text: print(f"{PROG} verify: {text}", file=sys.stderr, flush=True),
        )
    except (VerifyRunError, TimeoutError) as exc:
        print(f"{PROG}: verify of {schedule.name} failed on a rank: {exc}", file=sys.stderr)
        return 1
    return _verdict(report, report_lines, args.json, f"verify failed for {report.schedule}")


def _moe_problem(args: argparse.Namespace) -> str | None:
    """One line for a MoE request that cannot run (before any rank starts), else None."""
    if args.num_experts is None:
        given = [
            flag
            for flag, value, default in (
                ("--ep", args.ep, 1),
                ("--moe-topk", args.moe_topk, 2),
                ("--moe-aux-loss-coeff", args.moe_aux_loss_coeff, 1e-2),
                ("--moe-dispatcher", args.moe_dispatcher, "alltoall"),
                ("--overlap-moe", args.overlap_moe, False),
            )
            if value != default
        ]
        return f"{given[0]} goes with a MoE model: add --num-experts" if given else None
    if args.post_validation:
        return "--post-validation with --num-experts: not supported for MoE models (drop one of them)"
    if args.overlap_moe and (args.ep < 2 or args.moe_dispatcher != "alltoall"):
        return (
            "--overlap-moe needs --ep 2 or more and --moe-dispatcher alltoall (megatron: "
            "overlap_moe_expert_parallel_comm is only supported with expert model parallelism, with the "
            "alltoall/flex token dispatcher)"
        )
    return moe_problem(args.num_experts, args.moe_topk, args.ep, args.dp, args.tp, args.fsdp)


def _layer_split(args: argparse.Namespace, schedule: Any) -> Any:
    """The uneven split the flags ask for (None: even), or the one-line refusal naming the flag."""
    from ..schedules.layer_split import (
        SPLIT_FLAGS,
        LayerSplitError,
        check_mtp_layers,
        placement_layer_counts,
        split_from_args,
    )

    given = [flag for attr, flag in SPLIT_FLAGS if getattr(args, attr, None) not in (None, False)]
    if not given:
        return None
    try:
        split = split_from_args(args)
        num_layers = args.num_layers or schedule.placement.stages_per_replica * args.layers_per_stage
        placement_layer_counts(num_layers, schedule.placement, split)
        if split.layout is not None:
            check_mtp_layers(split.layout, args.mtp_num_layers)
    except (ValueError, LayerSplitError) as exc:
        placement = schedule.placement
        where = f"{schedule.name}: {placement.style} placement, {placement.stages_per_replica} model stages"
        return f"argument {given[0]}: {exc} ({where})"
    return split


def _run_post_validation(args: argparse.Namespace, schedule: Any, model: Any) -> int:
    from ..schedule_args import PROG
    from ..verification.post_validation_check import verify_post_validation
    from ..verification.rank_pool import VerifyRunError
    from ..verification.verify_report import post_validation_lines

    print(f"{PROG} verify: post-validation against megatron's synchronous step", file=sys.stderr, flush=True)
    try:
        pv = verify_post_validation(
            schedule,
            model=model,
            tp=args.tp,
            dp=args.dp,
            distributed_optimizer=args.distributed_optimizer,
            iterations=args.iterations,
            clip_grad=args.clip_grad,
            inject_inf=tuple(args.inject_inf),
            late=args.post_validation_late,
            timeout_s=args.timeout,
        )
    except (VerifyRunError, TimeoutError) as exc:
        print(f"{PROG}: post-validation run of {schedule.name} failed on a rank: {exc}", file=sys.stderr)
        return 1
    return _verdict(
        pv, post_validation_lines, args.json, f"post-validation differs from the synchronous step for {schedule.name}"
    )


def _verdict(result: Any, lines: Any, as_json: bool, failure: str) -> int:
    """Print a verify result (its JSON, or its lines) and return the exit code: 1 with ``failure`` on stderr
    when the result is not ok."""
    from ..schedule_args import PROG

    print(json.dumps(result.to_json_dict()) if as_json else "\n".join(lines(result)))
    if not result.ok:
        print(f"{PROG}: {failure}", file=sys.stderr)
        return 1
    return 0
