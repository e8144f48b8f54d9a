"""``megatron-pp bench --real-peers``: every schedule a peer runtime also has, ours against the peer's, on real
gloo ranks with real compute (one thread per rank), two model sizes, the same megatron-core chunks, weights,
data and micro-batch order for everyone.

Peers: torch.distributed.pipelining (:mod:`.real_peers`: 1F1B, GPipe, interleaved 1F1B, interleaved zero
bubble, ZBV, DualPipeV, looped BFS) and megatron-core's own 1F1B and interleaved 1F1B (``RunSpec`` mode ``AB``).
Each case also runs our 1f1b, the baseline of every gain, in the same rotation of iterations, traced beside ours:
the measured gain is the median ratio of paired iterations, and the simulated one comes from the op times and host
costs both traced runs measured (:func:`~megatron_pp_ext.analysis.host_costs.with_host_costs`), so the realized
share of the simulated gain over 1f1b, ``(measured gain - 1) / (simulated gain - 1)``, reads the runtime against
its plan without the drift of the machine's speed between cases. The split backward's
cost (torch's and ours, on a megatron chunk and on plain torch layers) is measured beside (:mod:`.split_cost`).
The text is built by :mod:`.real_peers_report`.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .real_peers_cases import SIZE_SHAPES, TORCH_PEERS, iterations_of, model_spec, num_microbatches

MEGATRON_PEERS = {"1f1b": "1F1B", "interleaved-1f1b": "interleaved 1F1B"}
P_RANGE = (2, 8)
DEFAULT_ITERATIONS, DEFAULT_WARMUP = 8, 2
BLOCK = "real-peers"  # the results file's blocks --write replaces are named by it and the pipeline sizes
FLAGS = ("real_peers", "peer_sizes")


class RealPeersError(ValueError):
    """Bad ``--real-peers`` input (one line naming the flag and the valid range)."""


@dataclass(frozen=True)
class RealPeersSettings:
    ps: tuple[int, ...]
    sizes: tuple[str, ...]
    schedules: tuple[str, ...]
    iterations: int
    warmup: int
    write: str | None
    command: str


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``--real-peers`` flags of ``megatron-pp bench`` (``-p``, ``--schedules``, ``--iterations``,
    ``--warmup`` and ``--write`` are shared with the command's other modes)."""
    group = parser.add_argument_group("real compute against peer runtimes (--real-peers; -p: sizes, default 2,4)")
    group.add_argument(
        "--real-peers",
        action="store_true",
        help="ours vs torch.distributed.pipelining's and megatron-core's runtimes on real gloo ranks, real compute",
    )
    group.add_argument(
        "--peer-sizes", default=None, metavar="NAME[,NAME]", help=f"model sizes (default {','.join(SIZE_SHAPES)})"
    )


def settings_from(args: argparse.Namespace) -> RealPeersSettings | None:
    """Check every ``--real-peers`` flag before anything is spawned (RealPeersError names flag and range);
    None without ``--real-peers`` (RealPeersError if one of its own flags was given)."""
    if not args.real_peers:
        if args.peer_sizes is not None:
            raise RealPeersError("--peer-sizes: only with --real-peers")
        return None
    if args.emulate or args.m_factors or args.plots or args.costs or args.m is not None:
        raise RealPeersError("--real-peers: not with --emulate, -m, --m-factors, --costs or --plots")
    try:
        ps = tuple(int(x) for x in (args.p_list or "2,4").split(","))
    except ValueError:
        raise RealPeersError(f"-p with --real-peers: comma-separated sizes in 2..8, got {args.p_list!r}") from None
    if not ps or any(not P_RANGE[0] <= p <= P_RANGE[1] for p in ps):
        raise RealPeersError(f"-p with --real-peers: each size in {P_RANGE[0]}..{P_RANGE[1]}, got {args.p_list!r}")
    sizes = tuple(x.strip() for x in (args.peer_sizes or ",".join(SIZE_SHAPES)).split(","))
    if not sizes or any(x not in SIZE_SHAPES for x in sizes):
        raise RealPeersError(f"--peer-sizes: names from {', '.join(SIZE_SHAPES)}, got {args.peer_sizes!r}")
    schedules = tuple(x.strip() for x in (args.schedules or ",".join(TORCH_PEERS)).split(","))
    if not schedules or any(x not in TORCH_PEERS for x in schedules):
        raise RealPeersError(f"--schedules with --real-peers: names from {', '.join(TORCH_PEERS)}, got {schedules}")
    if "1f1b" not in schedules:  # the baseline of every gain
        schedules = ("1f1b", *schedules)
    iterations = DEFAULT_ITERATIONS if args.iterations is None else args.iterations
    warmup = DEFAULT_WARMUP if args.warmup is None else args.warmup
    if not 1 <= iterations - warmup or iterations > 1000:
        raise RealPeersError(f"--iterations must be in {warmup + 1}..1000 (more than --warmup), got {iterations}")
    if args.write and not Path(args.write).resolve().parent.is_dir():
        raise RealPeersError(f"--write: no directory for {args.write!r}")
    command = f"megatron-pp bench --real-peers -p {','.join(map(str, ps))} --peer-sizes {','.join(sizes)}"
    command += f" --schedules {','.join(schedules)}" if args.schedules else ""
    command += f" --iterations {iterations} --warmup {warmup}" + (f" --write {args.write}" if args.write else "")
    return RealPeersSettings(ps, sizes, schedules, iterations, warmup, args.write, command)


def main(settings: RealPeersSettings) -> int:
    """``megatron-pp bench --real-peers``: run, print the report (or write its block); 1 when a rank failed."""
    import sys

    from ..verification.rank_pool import VerifyRunError

    try:
        text = run(settings, say=lambda line: print(line, flush=True))
    except (VerifyRunError, TimeoutError, RuntimeError) as exc:  # a rank failed or the ranks did not finish
        print(f"megatron-pp: error: bench --real-peers: {exc}", file=sys.stderr)
        return 1
    if not settings.write:
        print("\n" + text)
    return 0


def run(settings: RealPeersSettings, say: Any = print) -> str:
    """Every case of ``settings`` on real ranks; the report's text (also written with ``--write``)."""
    from ..verification.rank_run import TrainingRankPool
    from .real_peers_report import report
    from .results_file import block_markers, write_block

    cases: list[dict[str, Any]] = []
    split: dict[str, dict[str, Any]] = {}
    with TrainingRankPool(max(settings.ps)) as pool:
        for size in settings.sizes:
            split[size] = split_cost(pool, size, min(settings.ps))
            say(f"split cost, {size}: {split[size]}")
            for p in settings.ps:
                for name in settings.schedules:
                    cases.append(torch_case(pool, settings, name, p, size))
                    say(f"{name} p={p} {size}: {_brief(cases[-1])}")
                    if name in MEGATRON_PEERS:
                        cases.append(megatron_case(pool, settings, name, p, size))
                        say(f"{name} p={p} {size} vs megatron: {_brief(cases[-1])}")
    text = report(settings, cases, split)
    if settings.write:
        target = Path(settings.write)
        name = block_name(settings.ps)
        placed_after = "peers" if target.exists() and block_markers("peers")[0] in target.read_text() else None
        write_block(target, name, text, after=placed_after)  # after the simulator's peer tables when present
        say(f"wrote the {name} section of {settings.write}")
    return text


def block_name(ps: Any) -> str:
    """The results-file block of a run at pipeline sizes ``ps``: a run at other sizes keeps its own."""
    return f"{BLOCK} p={','.join(map(str, ps))}"


def _brief(case: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in case.items() if k in ("ratio", "ours_s", "peer_s", "refusal"))


def split_cost(pool: Any, size: str, p: int) -> dict[str, Any]:
    from ..verification.rank_pool import check_errors
    from . import split_cost as sc

    model = model_spec(size)
    results = pool.run_fn(sc.run_on_rank, sc.SplitCostSpec(model, model.num_layers // p), 1, wall_timeout_s=3600)
    check_errors(results)
    return {"layers": model.num_layers // p, **results[0]}


def paired(numerators: list[float], denominators: list[float]) -> tuple[float, tuple[float, float]]:
    """The median of the per-iteration ratios and their first and third quartiles (the middle half of the
    iterations: a median whose quartiles straddle 1 does not tell the two runtimes apart)."""
    ratios = [a / b for a, b in zip(numerators, denominators, strict=True)]
    if len(ratios) < 2:
        return round(ratios[0], 4), (round(ratios[0], 4), round(ratios[0], 4))
    q1, q2, q3 = statistics.quantiles(ratios, n=4, method="inclusive")
    return round(q2, 4), (round(q1, 4), round(q3, 4))


def _slowest(results: list[dict[str, Any]], name: str, warmup: int) -> list[float]:
    """Per iteration, the slowest rank's time of runtime ``name``, warm-up dropped."""
    n = min(len(r["step_times"][name]) for r in results)
    return [max(r["step_times"][name][i] for r in results) for i in range(n)][warmup:]


def _losses(results: list[dict[str, Any]], name: str) -> list[float]:
    """Every micro-batch loss of every iteration of runtime ``name``, in iteration order."""
    per_iteration = zip(*(r["losses"][name] for r in results), strict=True)
    return [x for row in per_iteration for rank_losses in row for x in rank_losses]


def torch_case(pool: Any, settings: RealPeersSettings, name: str, p: int, size: str) -> dict[str, Any]:
    """Ours vs torch's runtime for schedule ``name``: times, losses, the trace of ours, torch's op times."""
    from ..verification.rank_pool import check_errors
    from . import real_peers

    iterations = iterations_of(size, settings.iterations, settings.warmup)
    spec = real_peers.PeerRunSpec(name, p, num_microbatches(p), model_spec(size), iterations=iterations)
    results = sorted(pool.run_fn(real_peers.run_on_rank, spec, p, wall_timeout_s=3600), key=lambda r: r["rank"])
    check_errors(results)
    refusal = next((r["refusal"] for r in results if r["refusal"]), None)
    ours = _slowest(results, real_peers.OURS, settings.warmup)
    case: dict[str, Any] = {
        "schedule": name,
        "peer": f"torch {TORCH_PEERS[name]}",
        "p": p,
        "size": size,
        "ours_s": round(statistics.median(ours), 4),
        "ours_losses": _losses(results, real_peers.OURS),
        "traces": [r["ours_trace"] for r in results],
        "torch_op_times": [r["torch_op_times_s"] for r in results],
        "refusal": refusal,
    }
    if results[0]["baseline_trace"] is not None:  # our 1f1b ran in the same rotation: the gain over it is paired
        baseline = _slowest(results, real_peers.BASELINE, settings.warmup)
        case["baseline_s"] = round(statistics.median(baseline), 4)
        case["measured_gain"], case["measured_gain_quartiles"] = paired(baseline, ours)
        case["baseline_traces"] = [r["baseline_trace"] for r in results]
    if refusal is None:
        theirs = _slowest(results, real_peers.TORCH, settings.warmup)
        case["peer_s"] = round(statistics.median(theirs), 4)
        case["ratio"], case["ratio_quartiles"] = paired(ours, theirs)
        case["peer_losses"] = _losses(results, real_peers.TORCH)
        if results[0]["torch_plain_step_times"]:
            n = len(results[0]["torch_plain_step_times"])
            plain = [max(r["torch_plain_step_times"][i] for r in results) for i in range(n)][settings.warmup :]
            case["torch_plain_s"] = round(statistics.median(plain), 4)
    return case


def megatron_case(pool: Any, settings: RealPeersSettings, name: str, p: int, size: str) -> dict[str, Any]:
    """Ours vs megatron-core's own function for ``name`` (1f1b or interleaved-1f1b), megatron DDP on both."""
    from ..schedules import generate
    from ..verification.rank_pool import check_errors
    from ..verification.run_spec import AB, NATIVE, OURS, RunSpec

    v = 2 if name == "interleaved-1f1b" else None
    schedule = generate(name, p, num_microbatches(p), v=v)
    spec = RunSpec(
        pp=p,
        num_microbatches=num_microbatches(p),
        schedule_csv=schedule.to_csv(),
        model=model_spec(size),
        iterations=iterations_of(size, settings.iterations, settings.warmup),
        mode=AB,
        timeout_s=600.0,
        megatron_overlap_p2p=p == 2 and v is not None,  # megatron's batched p2p swaps the two messages at p = 2
    )
    results = sorted(pool.run(spec, wall_timeout_s=3600), key=lambda r: r.get("pp_rank", 0))
    check_errors(results)
    ours, native = _slowest(results, OURS, settings.warmup), _slowest(results, NATIVE, settings.warmup)
    ratio, quartiles = paired(ours, native)
    return {
        "schedule": name,
        "peer": f"megatron-core {MEGATRON_PEERS[name]}" + (" (overlap_p2p_comm)" if spec.megatron_overlap_p2p else ""),
        "p": p,
        "size": size,
        "ours_s": round(statistics.median(ours), 4),
        "peer_s": round(statistics.median(native), 4),
        "ratio": ratio,
        "ratio_quartiles": quartiles,
        "ours_losses": _losses(results, OURS),
        "peer_losses": _losses(results, NATIVE),
        "refusal": None,
    }
