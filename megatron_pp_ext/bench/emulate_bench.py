"""``megatron-pp bench --emulate``: every applicable schedule on real gloo ranks with emulated compute.

For one pipeline size ``p`` and ``m`` micro-batches, each schedule runs on ``p`` spawned ranks (real
megatron-core GPTModel chunks, megatron DDP, real tensors through our executor) with every F, B, W and
BW op padded to the ``--costs`` wall time (:mod:`.emulate`); the simulator gets the same costs and the
measured one-way p2p time. Reported per schedule: simulated and measured (median) iteration time, their
ratio, the gains over 1f1b both ways, and where each rank's time went; our 1f1b and interleaved-1f1b are
also timed against megatron-core's own schedules on the same ranks (alternating iterations).

Only argument parsing lives at module level (no torch): the ``bench`` parser of the CLI adds these flags
without importing the runtime.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from typing import Any

from .. import argtypes
from .emulate_results import BASELINE, COMM_THREAD, P2P_ROUNDS, SECTION, Outcome, Row, Settings

DEFAULT_ITERATIONS, DEFAULT_WARMUP = 5, 2
KINDS = ("F", "B", "W", "BW")
DEFAULT_COSTS = "20,20,15"  # ms per 1F1B stage: T_F, T_B, T_W (BW = B + W)
MAX_PAD_MS = 1000.0
P_RANGE = (2, 8)  # ranks spawned on this machine
M_MAX = 64
STARTUP_TIMEOUT_S = 900.0  # the first job waits for the ranks' imports too (minutes on a loaded machine)


class EmulateError(ValueError):
    """Bad input for ``bench --emulate`` (one line naming the flag and its valid range)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--emulate`` flags of ``megatron-pp bench`` (``-p``, ``--write`` and ``--plots`` are the
    command's own and take their emulated meaning with ``--emulate``)."""
    group = parser.add_argument_group(
        "emulated compute on real ranks (--emulate; -p is then one pipeline size, default 2)"
    )
    group.add_argument(
        "--emulate",
        action="store_true",
        help="run every applicable schedule on real gloo ranks with each op padded to --costs, next to the "
        "simulator and megatron-core's own 1F1B / interleaved 1F1B",
    )
    group.add_argument("-m", type=argtypes.positive_int, default=None, help="micro-batches per iteration (default 2p)")
    group.add_argument(
        "--schedules",
        default=None,
        metavar="NAME[,NAME...]",
        help="schedules to run (default: every registered one; 1f1b, the baseline of the gains, always runs)",
    )
    group.add_argument(
        "--iterations",
        type=argtypes.positive_int,
        default=None,
        metavar="N",
        help=f"timed iterations (median, default {DEFAULT_ITERATIONS})",
    )
    group.add_argument(
        "--warmup",
        type=argtypes.nonnegative_int,
        default=None,
        metavar="N",
        help=f"untimed iterations first (default {DEFAULT_WARMUP})",
    )
    group.add_argument(
        "--costs",
        default=None,
        metavar="F,B,W[,COMM]",
        help=f"wall time in ms of one 1F1B stage's F, B and W (default {DEFAULT_COSTS}; a rank holding k stages "
        "per replica pads each of its ops to 1/k); COMM: the simulator's hop time (default: measured)",
    )
    group.add_argument(
        "--a2a-ms",
        type=argtypes.a2a_time,
        default=None,
        metavar="T",
        help="wall time in ms of one expert-parallel all-to-all (dispatch or combine) of one MoE layer, padded on "
        "the communication side: each F, B and BW of a 1F1B stage lasts 2 x --moe-layers x T longer (1/k of it "
        "on a rank holding k stages per replica); the simulator gets the same (docs/moe.md)",
    )
    group.add_argument(
        "--moe-layers",
        type=argtypes.positive_int,
        default=None,
        metavar="N",
        help="MoE layers per 1F1B stage for --a2a-ms (default 1)",
    )
    group.add_argument(
        "--overlap-moe-expert-parallel-comm",
        dest="overlap_moe",
        action="store_true",
        default=None,
        help="with --a2a-ms: a tiny MoE GPT at EP = 2 (2p ranks), every schedule run twice, without and with "
        "megatron's all-to-all overlap (its combined step), each dispatch and combine padded by --a2a-ms where "
        "it runs; megatron's interleaved 1F1B with its combined 1F1B beside interleaved-1f1b (docs/moe.md)",
    )


EMULATE_ONLY = ("m", "schedules", "costs", "iterations", "warmup", "a2a_ms", "moe_layers", "overlap_moe")
FLAG_NAMES = {"overlap_moe": "--overlap-moe-expert-parallel-comm"}
OVERLAP_P_MAX = 4  # 2p ranks with the overlap (EP = 2)
OVERLAP_EP, OVERLAP_EXPERTS = 2, 4


def settings_from(args: argparse.Namespace) -> Settings | None:
    """Check every ``--emulate`` flag before anything is spawned; EmulateError names the flag and range.
    Without ``--emulate``: None, or EmulateError if one of its own flags was given. Long because it checks
    each flag in turn, in the order a user reads them, each with its own one-line refusal."""
    from ..schedule_args import parse_cli_costs
    from ..schedules import registry

    if not args.emulate:
        given = [
            FLAG_NAMES.get(name) or ("--" if len(name) > 1 else "-") + name.replace("_", "-")
            for name in EMULATE_ONLY
            if getattr(args, name) is not None
        ]
        if given:
            raise EmulateError(f"{', '.join(given)}: only with --emulate")
        return None
    if args.m_factors is not None:
        raise EmulateError("--m-factors: not with --emulate (give -m)")
    text = args.p_list if args.p_list is not None else str(P_RANGE[0])
    try:
        p = int(text)
    except ValueError:
        raise EmulateError(f"-p with --emulate must be one size in {P_RANGE[0]}..{P_RANGE[1]}, got {text!r}") from None
    if not P_RANGE[0] <= p <= P_RANGE[1]:
        raise EmulateError(f"-p with --emulate must be in {P_RANGE[0]}..{P_RANGE[1]}, got {p}")
    m = args.m if args.m is not None else 2 * p
    if m > M_MAX:
        raise EmulateError(f"-m must be in 1..{M_MAX}, got {m}")
    iterations = DEFAULT_ITERATIONS if args.iterations is None else args.iterations
    warmup = DEFAULT_WARMUP if args.warmup is None else args.warmup
    if iterations > 1000:
        raise EmulateError(f"--iterations must be in 1..1000, got {iterations}")
    if warmup > 100:
        raise EmulateError(f"--warmup must be in 0..100, got {warmup}")
    names = registry.names()
    wanted = tuple(x.strip() for x in args.schedules.split(",") if x.strip()) if args.schedules else tuple(names)
    unknown = [x for x in wanted if x not in names]
    if unknown or not wanted:
        raise EmulateError(f"--schedules: unknown {unknown or '(empty list)'}; registered: {', '.join(names)}")
    if BASELINE not in wanted:  # the gains are over 1f1b
        wanted = (BASELINE, *wanted)
    costs_text = args.costs or DEFAULT_COSTS
    costs = parse_cli_costs(costs_text)
    assert costs is not None
    comm_given = len(costs_text.split(",")) == 4
    if max(costs.t_f, costs.t_b, costs.t_w, costs.t_comm) > MAX_PAD_MS:  # type: ignore[type-var]
        raise EmulateError(f"--costs F,B,W[,COMM] with --emulate are ms, each in [0, {MAX_PAD_MS:g}], got {costs_text}")
    if args.moe_layers is not None and args.a2a_ms is None:
        raise EmulateError("--moe-layers: only with --a2a-ms")
    a2a_ms = args.a2a_ms or 0.0
    moe_layers = (args.moe_layers or 1) if args.a2a_ms is not None else 0
    if a2a_ms > MAX_PAD_MS or 2 * moe_layers * a2a_ms > MAX_PAD_MS:
        raise EmulateError(
            f"--a2a-ms x 2 x --moe-layers must be in [0, {MAX_PAD_MS:g}] ms, got {a2a_ms:g} x {moe_layers}"
        )
    overlap = bool(args.overlap_moe)
    if overlap and args.a2a_ms is None:
        raise EmulateError("--overlap-moe-expert-parallel-comm: only with --a2a-ms (the time of one all-to-all)")
    if overlap and p > OVERLAP_P_MAX:
        raise EmulateError(
            f"-p with --overlap-moe-expert-parallel-comm must be in {P_RANGE[0]}..{OVERLAP_P_MAX} "
            f"(EP = {OVERLAP_EP}: 2p ranks), got {p}"
        )
    if args.plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise EmulateError("--plots needs matplotlib: pip install 'megatron_pp_ext[plot]'") from None
    command = f"megatron-pp bench --emulate -p {p} -m {m}"
    command += f" --schedules {','.join(wanted)}" if args.schedules else ""
    command += f" --iterations {iterations} --warmup {warmup} --costs {costs_text}"
    command += f" --a2a-ms {a2a_ms:g} --moe-layers {moe_layers}" if args.a2a_ms is not None else ""
    command += " --overlap-moe-expert-parallel-comm" if overlap else ""
    command += (f" --write {args.write}" if args.write else "") + (f" --plots {args.plots}" if args.plots else "")
    return Settings(
        p=p,
        m=m,
        schedules=wanted,
        iterations=iterations,
        warmup=warmup,
        t_f=float(costs.t_f),  # type: ignore[arg-type]
        t_b=float(costs.t_b),  # type: ignore[arg-type]
        t_w=float(costs.t_w),  # type: ignore[arg-type]
        comm_ms=costs.t_comm if comm_given else None,
        a2a_ms=a2a_ms,
        moe_layers=moe_layers,
        overlap=overlap,
        write=args.write,
        plots=args.plots,
        command=command,
    )


# ------------------------------------------------------------------------------------------------
# One schedule: its simulation and its measured run
# ------------------------------------------------------------------------------------------------
def stage_costs(settings: Settings, schedule: Any, comm_ms: float) -> Any:
    """The schedule's per-stage costs (ms): a rank holding ``k`` stages per replica gets 1/k of a
    1F1B stage's time per op, as it holds 1/k of the layers."""
    from ..schedules.costs import Costs

    k = schedule.placement.stages_per_rank_per_replica
    return Costs(settings.t_f / k, settings.t_b / k, settings.t_w / k, None, comm_ms)


def moe_comm(settings: Settings, schedule: Any, overlap: bool = False) -> Any:
    """The simulator's all-to-all model of the emulated run (None without ``--a2a-ms``): a rank holding ``k``
    stages per replica pays 1/k of a 1F1B stage's all-to-all time per op, launched by the host (CPU);
    ``overlap``: the schedule's marked pairs on two streams."""
    from ..analysis.moe_comm import MoeComm

    if not settings.moe_layers:
        return None
    k = schedule.placement.stages_per_rank_per_replica
    return MoeComm(settings.a2a_ms / k, settings.moe_layers, overlap=overlap, host_launch=True)


def overlap_variants(settings: Settings, built: list[tuple[Any, Any]]) -> tuple[list[tuple[Any, Any, bool]], dict]:
    """Each built schedule without overlap and, with ``settings.overlap``, in its overlapped order
    (:func:`~megatron_pp_ext.analysis.overlap_order.overlap_order`, what the executor runs) where some rank has a
    steady state of pairs (what the driver's flag check accepts); the others skipped, with why."""
    from ..analysis.overlap_order import overlap_order

    out: list[tuple[Any, Any, bool]] = []
    skipped: dict[str, str] = {}
    for schedule, costs in built:
        out.append((schedule, costs, False))
        if not settings.overlap:
            continue
        marked = overlap_order(schedule)
        if max((len(row) for row in marked.overlap_pairs), default=0) < 2:
            skipped[f"{schedule.name} + overlap"] = "no steady state of F&B pairs (the flag is refused with it)"
            continue
        out.append((marked, costs, True))
    return out, skipped


def _job(settings: Settings, schedule: Any, costs: Any, overlap: bool = False) -> Any:
    """The ranks' job. Without ``settings.overlap`` (a dense model): every all-to-all padded onto its op.
    With it (a MoE model at EP = 2, emulate_moe.py): each all-to-all padded where it runs; each op's
    floor is its compute plus its all-to-alls one after the other (they run inline); with ``overlap`` an
    overlapped pair's compute is split over its nodes instead (the pair itself unpadded)."""
    from .emulate import NATIVE_INTERLEAVED, NATIVE_PEERS, EmulateJob
    from .emulate_a2a import A2APads

    t_f, t_b, t_w, t_bw = costs.per_stage(schedule.num_stages)
    moe = moe_comm(settings, schedule)
    layers = max(settings.moe_layers, 1)
    node_pads = {kind: tuple(x / 2 / layers / 1000 for x in t) for kind, t in (("F", t_f), ("B", t_b), ("BW", t_bw))}
    native_node_pads = (t_f[0] / 2 / layers / 1000, t_bw[0] / 2 / layers / 1000)
    if moe is not None:  # every all-to-all one after the other with its op (emulate_a2a.py)
        a2a = A2APads(moe.a2a, tuple(moe.per_stage(schedule.num_stages)))
        t_f, t_b, t_bw = (
            [x + a2a.serial_s(kind, stage) for stage, x in enumerate(t)]
            for kind, t in zip(("F", "B", "BW"), (t_f, t_b, t_bw), strict=True)
        )
    pads = {kind: tuple(x / 1000 for x in values) for kind, values in zip(KINDS, (t_f, t_b, t_w, t_bw), strict=True)}
    # with overlap a pair's compute is padded node by node and its all-to-alls where they run (the tracer pads
    # no pair); an op outside a pair keeps its floor of compute plus its all-to-alls one after the other
    native = schedule.name if schedule.name in NATIVE_PEERS else None
    if overlap and native != NATIVE_INTERLEAVED:  # megatron's combined 1F1B runs only in its interleaved 1F1B
        native = None
    return EmulateJob(
        name=schedule.name,
        pp=settings.p,
        num_microbatches=settings.m,
        schedule_csv=schedule.to_csv(),
        pads_s=pads,
        model=_model(settings, schedule),
        warmup=settings.warmup,
        iterations=settings.iterations,
        native=native,
        native_pads_s=(t_f[0] / 1000, t_bw[0] / 1000),
        ep=OVERLAP_EP if settings.overlap else 1,
        a2a_s=moe.a2a / 1000 if settings.overlap and moe is not None else 0.0,
        overlap_moe=overlap,
        node_pads_s=node_pads,
        native_node_pads_s=native_node_pads,
    )


def _model(settings: Settings, schedule: Any) -> Any:
    """The tiny GPT: one layer per stage; with the overlap ``--moe-layers`` MoE layers per stage."""
    from ..verification.tiny_gpt import TinyGPTSpec

    stages = schedule.placement.stages_per_replica
    if not settings.overlap:
        return TinyGPTSpec(num_layers=stages)
    return TinyGPTSpec(num_layers=stages * settings.moe_layers, num_experts=OVERLAP_EXPERTS)


def _median_per_iteration(results: list[dict[str, Any]], name: str, warmup: int) -> list[float]:
    """Per timed iteration, the slowest rank's wall time of ``name``'s forward-backward (s)."""
    per_rank = [r["times"][name][warmup:] for r in results]
    return [max(values) for values in zip(*per_rank, strict=True)]


def _rank_breakdown(result: dict[str, Any], warmup: int) -> dict[str, Any]:
    """Median over timed iterations of each part of one rank's iteration, ms."""
    timed = result["breakdowns"][warmup:]

    def med(get: Any) -> float:
        return statistics.median(get(b) for b in timed) * 1000

    out: dict[str, Any] = {
        "rank": result["pp_rank"],
        "compute": med(lambda b: b["compute"]),
        "real_compute": med(lambda b: b["real_compute"]),
        "post": med(lambda b: b["post"]),
        "recv_wait": med(lambda b: b["recv_wait"]),
        "send_wait": med(lambda b: b["send_wait"]),
        "between": med(lambda b: b["between"]),
        "drain": med(lambda b: b["drain"]),
        "outside": med(lambda b: b["outside"]),
    }
    for kind in ("F", "B", "BW", "W"):
        out[f"wait_{kind}"] = med(lambda b, k=kind: b["wait"].get(k, 0.0))
    out["idle"] = med(lambda b: b["span"] + b["outside"] - b["compute"])
    gap, op = max((w for b in timed for w in b["longest_waits"]), default=(0.0, "-"))
    out["longest_wait"] = f"{op} {gap * 1000:.1f}"
    return out


def fill_measured(row: Row, results: list[dict[str, Any]], warmup: int) -> None:
    """Row figures from the ranks' results of its job."""
    ours = _median_per_iteration(results, "ours", warmup)
    row.measured = statistics.median(ours) * 1000
    row.ranks = [_rank_breakdown(r, warmup) for r in sorted(results, key=lambda r: r["pp_rank"])]
    ops = [op[1:6] for r in results for op in r["ops"] if op[0] >= warmup]  # (name, kind, real, pad, lasted)
    row.ops = len(ops)
    row.short_ops = sum(1 for *_, pad, lasted in ops if lasted < pad)
    row.over_pad = sum(1 for *_, real, pad, _ in ops if 0 < pad < real)  # unpadded ops (overlap: F, B) not counted
    row.real_ms = _real_ms((kind, real) for _, kind, real, _, _ in ops)
    counts = [(thread, n) for r in results for (_, _, thread), n in r.get("a2a_threads", [])]
    row.a2a_on_worker = (sum(n for t, n in counts if t == COMM_THREAD), sum(n for _, n in counts))
    native_ops = [op[1:] for r in results for op in r["native_ops"] if op[0] >= warmup]  # (kind, real, pad, lasted)
    if row.native is not None:
        native = _median_per_iteration(results, "megatron", warmup)
        row.native_measured = statistics.median(native) * 1000
        row.ours_vs_native = statistics.median(a / b for a, b in zip(ours, native, strict=True))
        row.native_ops = len(native_ops)
        row.native_short_ops = sum(1 for *_, pad, lasted in native_ops if lasted < pad)
        row.native_over_pad = sum(1 for _, real, pad, _ in native_ops if real > pad)
        row.native_real_ms = _real_ms((kind, real) for kind, real, _, _ in native_ops)


def paid_hop_ms(schedule: Any, results: list[dict[str, Any]], warmup: int) -> tuple[float, int] | None:
    """The hop time the run paid: over the timed iterations, for every message whose consumer had
    nothing else to do (the op before it on its rank ended before the producer did), the time from the
    producer op's end to the consumer op's start; median (ms) and how many. None without such a message.

    The ping-pong of :func:`~.emulate.measure_p2p_latency` times the transport alone; this adds what a
    message costs a runtime around it (posting the send after the producer, waking the consumer, the
    bookkeeping on both sides), read off the ops' start and end times, which every rank takes on the
    machine's one monotonic clock."""
    from ..schedules import lower

    plan = lower(schedule).plan
    assert plan is not None
    spans: dict[tuple[int, int, str], tuple[float, float]] = {}  # (iteration, rank, op) -> (start, end)
    for result in results:
        for iteration, name, _kind, _real, _pad, lasted, started in result["ops"]:
            if iteration >= warmup:
                spans[(iteration, result["pp_rank"], name)] = (started, started + lasted)
    iterations = sorted({key[0] for key in spans})
    hops: list[float] = []
    for mid in range(plan.num_messages):
        src, dst = plan.src_rank[mid], plan.dst_rank[mid]
        producer = str(schedule.ops[src][plan.send_gap[mid] - 1])
        consumer_index = plan.consumer[mid]
        consumer = str(schedule.ops[dst][consumer_index])
        before = str(schedule.ops[dst][consumer_index - 1]) if consumer_index > 0 else None
        for it in iterations:
            produced, consumed = spans.get((it, src, producer)), spans.get((it, dst, consumer))
            if produced is None or consumed is None:
                continue
            previous = spans.get((it, dst, before)) if before is not None else None
            if previous is not None and previous[1] > produced[1]:
                continue  # the consumer's rank was still busy when the message was sent
            hops.append((consumed[0] - produced[1]) * 1000)
    return (statistics.median(hops), len(hops)) if hops else None


def host_costs_ms(schedule: Any, row: Row) -> tuple[float, float]:
    """The host time ``row``'s run paid per op (its ranks' time between ops over their ops) and per op that
    sends to another rank (their posting time over those ops): medians over the ranks, ms. What
    :func:`~megatron_pp_ext.analysis.host_costs.with_host_costs` charges."""
    from ..analysis.host_costs import sends_off_rank

    per_op, per_exchange = [], []
    for part in row.ranks:
        ops = schedule.ops[part["rank"]]
        per_op.append(part["between"] / len(ops))
        senders = sum(
            1 for op in ops if op.kind != "W" and sends_off_rank(schedule.placement, op.stage, op.kind == "F")
        )
        if senders:
            per_exchange.append(part["post"] / senders)
    return statistics.median(per_op), statistics.median(per_exchange) if per_exchange else 0.0


def _real_ms(ops: Any) -> dict[str, tuple[float, float]]:
    """Per op kind: the median and the largest real compute (before padding), ms."""
    by_kind: dict[str, list[float]] = {}
    for kind, real in ops:
        by_kind.setdefault(kind, []).append(real * 1000)
    return {kind: (statistics.median(values), max(values)) for kind, values in by_kind.items()}


# ------------------------------------------------------------------------------------------------
# The run
# ------------------------------------------------------------------------------------------------
def build_schedules(settings: Settings, comm_ms: float) -> tuple[list[tuple[Any, Any]], dict[str, str]]:
    """The requested schedules that build at ``(p, m)``, validated, each with its per-stage costs."""
    from ..analysis.schedule_check import validate
    from ..schedule_args import generate_schedule
    from ..schedules.costs import Costs
    from ..schedules.ir import ScheduleError

    base = Costs(settings.t_f, settings.t_b, settings.t_w, None, comm_ms)
    built: list[tuple[Any, Any]] = []
    skipped: dict[str, str] = {}
    for name in settings.schedules:
        try:
            schedule = generate_schedule(name, settings.p, settings.m, None, base)
            validate(schedule)
        except ScheduleError as exc:
            skipped[name] = str(exc).splitlines()[0]
            continue
        built.append((schedule, stage_costs(settings, schedule, comm_ms)))
    return built, skipped


def run_emulation(settings: Settings, pool: Any = None, say: Any = print) -> Outcome:
    """Measure the p2p time, then run and simulate every schedule; ``pool``: a RankPool of >= p ranks."""
    from ..analysis.schedule_check import validate
    from ..analysis.simulate import simulate
    from ..verification.rank_pool import RankPool, check_errors
    from ..verification.tiny_gpt import TinyGPTSpec
    from .emulate import measure_p2p_latency, run_job

    started = time.monotonic()
    load_start = os.getloadavg()[0]
    own = pool is None
    if own:
        say(f"starting {settings.ranks} rank processes (imports take ~10 s per process)")
        pool = RankPool(settings.ranks)
    try:
        model = TinyGPTSpec()
        shape = (model.seq_length, model.micro_batch_size, model.hidden_size)
        comm_ms, fastest_ms = settings.comm_ms, None
        if comm_ms is None:
            latency = pool.run_fn(measure_p2p_latency, (settings.p, shape, P2P_ROUNDS), settings.p, STARTUP_TIMEOUT_S)
            check_errors(latency)
            comm_ms, fastest_ms = latency[0][0] * 1000, latency[0][1] * 1000
            say(
                f"p2p: {comm_ms:.3f} ms one way (median of {P2P_ROUNDS} round trips of a {shape} fp32 tensor; "
                f"fastest {fastest_ms:.3f} ms)"
            )
        built, skipped = build_schedules(settings, comm_ms)  # the generators that take costs get the hop time
        variants, no_pairs = overlap_variants(settings, built)
        skipped.update(no_pairs)
        rows = []
        lowered = []  # per schedule, for the second simulation
        paid: tuple[float, int] | None = None
        for schedule, costs, overlap in variants:
            lowered.append(validate(schedule))
            moe = moe_comm(settings, schedule, overlap)
            sim = simulate(schedule, costs, lowered=lowered[-1], moe=moe).makespan
            job = _job(settings, schedule, costs, overlap)
            row = Row(schedule.name, schedule.chunks_per_rank, sim, overlap=overlap, native=job.native)
            say(f"{row.label}: running {settings.warmup} + {settings.iterations} iterations")
            results = pool.run_fn(run_job, job, job.world_size, wall_timeout_s=job.timeout_s * 4 + 120)
            check_errors(results)
            fill_measured(row, results, settings.warmup)
            if schedule.name == BASELINE and not overlap:
                paid = paid_hop_ms(schedule, results, settings.warmup)
            rows.append(row)
        if paid is not None:  # every schedule again, with the hop the baseline's run paid (and its host costs)
            from ..analysis.host_costs import with_host_costs

            for row, (schedule, costs, overlap), low in zip(rows, variants, lowered, strict=True):
                repriced = dataclasses.replace(costs, t_comm=paid[0])
                moe = moe_comm(settings, schedule, overlap)
                row.simulated_paid_hop = simulate(schedule, repriced, lowered=low, moe=moe).makespan
                if not overlap:
                    charged = with_host_costs(repriced, schedule.placement, *host_costs_ms(schedule, row))
                    row.simulated_host = simulate(schedule, charged, lowered=low, moe=moe).makespan
    finally:
        if own:
            pool.close()
    base = next((r for r in rows if r.name == BASELINE and not r.overlap), None)
    for row in rows:
        if base is not None:
            row.sim_gain = base.simulated / row.simulated
            row.measured_gain = base.measured / row.measured
    return Outcome(
        settings,
        comm_ms,
        fastest_ms,
        rows,
        skipped,
        (load_start, os.getloadavg()[0]),
        time.monotonic() - started,
        paid_hop_ms=paid,
    )


def run(args: argparse.Namespace) -> int:
    """``megatron-pp bench --emulate``: run, print the report, write and draw on request."""
    from ..verification.rank_pool import VerifyRunError
    from . import emulate_report

    settings = settings_from(args)
    assert settings is not None  # called with --emulate
    try:
        outcome = run_emulation(settings, say=lambda text: print(text, flush=True))
    except (VerifyRunError, TimeoutError, RuntimeError) as exc:  # a rank failed or the ranks did not finish
        print(f"megatron-pp: error: bench --emulate: {exc}", file=sys.stderr)
        return 1
    link = None
    if settings.plots:
        path = emulate_report.draw(outcome, settings.plots)
        base = os.path.dirname(os.path.abspath(settings.write)) if settings.write else os.getcwd()
        link = os.path.relpath(path.resolve(), base)
    text = emulate_report.report(outcome, link)
    print()
    print(text)
    if settings.write:
        emulate_report.write_block(settings.write, settings, text)
        print(f"wrote p={settings.p} m={settings.m} into the {SECTION!r} section of {settings.write}")
    return 0
