"""The text of ``megatron-pp bench --real-peers``: the peer table (ours / peer, losses, simulated and measured
gains over 1f1b, realized share), where ours spends its host time between ops, and the split backward's cost.

The simulation of each case's schedule and of the 1f1b traced beside it is fed by the op times its traced run
measured (per stage: F, and B, W for a split schedule or BW for a fused one) and by that run's host costs
(bookkeeping per op, posting per exchange: :func:`~megatron_pp_ext.analysis.host_costs.with_host_costs`).
"""

from __future__ import annotations

from typing import Any

from ..analysis.host_costs import with_host_costs
from ..analysis.simulate import simulate
from ..schedules.costs import Costs
from .real_peers import BASELINE_SCHEDULE, PeerRunSpec, generate_ours
from .real_peers_cases import describe, iterations_of, model_spec, num_microbatches
from .realized import realized_text


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)] + [
        "| " + " | ".join(r) + " |" for r in rows
    ]


def stage_costs(traces: list[dict[str, Any]], num_stages: int) -> Costs:
    """Costs per stage (seconds) from the op times every rank's trace measured."""
    times: dict[str, dict[int, float]] = {}
    for trace in traces:
        for kind, per_stage in trace["op_times_s"].items():
            for stage, t in per_stage.items():
                times.setdefault(kind, {})[int(stage)] = t
    f, b, w, bw = [], [], [], []
    for s in range(num_stages):
        f.append(times["F"][s])
        if s in times.get("B", {}) and s in times.get("W", {}):
            b.append(times["B"][s])
            w.append(times["W"][s])
            bw.append(times.get("BW", {}).get(s, b[-1] + w[-1]))
        else:
            bw.append(times["BW"][s])
            b.append(bw[-1] / 2)
            w.append(bw[-1] / 2)
    return Costs(tuple(f), tuple(b), tuple(w), tuple(bw), 0.0)


def host_costs(traces: list[dict[str, Any]]) -> tuple[float, float]:
    """(bookkeeping seconds per op, posting seconds per exchange: the median posting, as a posting that waits
    for the send bound holds a wait, not host work), averaged over the ranks."""
    per_op = sum(t["host"]["per_op_s"]["bookkeeping"] for t in traces) / len(traces)
    posting = [t["host"]["parts"]["p2p posting"]["median_s"] for t in traces if "p2p posting" in t["host"]["parts"]]
    return per_op, (sum(posting) / len(posting) if posting else 0.0)


def simulated(case: dict[str, Any], baseline: bool = False) -> float:
    """Makespan in seconds of ``case``'s schedule with the op times and host costs its traced run measured;
    ``baseline``: of our 1f1b, from the traced run of it in the same case."""

    p = case["p"]
    name, traces = (BASELINE_SCHEDULE, case["baseline_traces"]) if baseline else (case["schedule"], case["traces"])
    schedule = generate_ours(PeerRunSpec(name, p, num_microbatches(p), model_spec(case["size"])))
    costs = stage_costs(traces, schedule.placement.num_stages)
    per_op, per_exchange = host_costs(traces)
    return simulate(schedule, with_host_costs(costs, schedule.placement, per_op, per_exchange)).makespan


def _rel_diff(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)), default=0.0)


def _with_quartiles(median: float, quartiles: tuple[float, float] | None) -> str:
    """``median (q1-q3)``: the middle half of the paired iterations' ratios beside their median."""
    return f"{median:.3f}" if quartiles is None else f"{median:.3f} ({quartiles[0]:.3f}-{quartiles[1]:.3f})"


def _peer_rows(cases: list[dict[str, Any]]) -> list[list[str]]:
    base = {(c["p"], c["size"]): c for c in cases if c["schedule"] == "1f1b" and c["peer"].startswith("torch")}
    rows = []
    for c in cases:
        ref = base[(c["p"], c["size"])]
        ours_loss = f"{_rel_diff(c['ours_losses'], ref['ours_losses']):.1e}"
        if c["refusal"]:
            peer, ratio, peer_loss = f"{c['peer']}: refused ({c['refusal'][:160]})", "-", "-"
        else:
            peer, ratio = c["peer"], _with_quartiles(c["ratio"], c.get("ratio_quartiles"))
            peer_loss = f"{_rel_diff(c['peer_losses'], c['ours_losses']):.1e}"
        cells = ["", "", "", "", "", ""]
        if "traces" in c:  # gains over the 1f1b run in the same case (1 for the 1f1b case itself)
            sim = simulated(c)
            paired = "baseline_traces" in c
            sim_gain = simulated(c, baseline=True) / sim if paired else 1.0
            meas_gain = c["measured_gain"] if paired else 1.0
            cells = [
                f"{c.get('baseline_s', c['ours_s']) * 1e3:.1f}",
                f"{c['ours_s'] / sim:.3f}",
                f"{sim_gain:.3f}",
                _with_quartiles(meas_gain, c.get("measured_gain_quartiles")),
                f"{meas_gain / sim_gain:.3f}",
                realized_text(meas_gain, sim_gain),
            ]
        rows.append([c["schedule"], peer, str(c["p"]), c["size"], f"{c['ours_s'] * 1e3:.1f}"])
        plain = f"{c['torch_plain_s'] * 1e3:.1f}" if "torch_plain_s" in c else ""
        peer_ms = f"{c['peer_s'] * 1e3:.1f}" if not c["refusal"] else "-"
        rows[-1] += [peer_ms, plain, ratio, ours_loss, peer_loss, *cells]
    return rows


def _host_rows(cases: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for c in cases:
        if "traces" not in c:
            continue
        traces = c["traces"]
        per_op, per_exchange = host_costs(traces)
        wait = sum(t["host"]["per_op_s"].get("p2p wait", 0.0) for t in traces) / len(traces)
        forward = [  # per stage: the median F less the median forward of the model itself
            t["op_times_s"]["F"][stage] - model for t in traces for stage, model in t["model_forward_s"].items()
        ]
        ops = sum(t["host"]["ops"] for t in traces) // len(traces)
        rows.append(
            [c["schedule"], str(c["p"]), c["size"], str(ops), f"{per_op * 1e6:.0f}", f"{per_exchange * 1e6:.0f}"]
        )
        rows[-1] += [f"{wait * 1e6:.0f}", f"{sum(forward) / len(forward) * 1e6:.0f}" if forward else "-"]
    return rows


def _backward_over_forward(per_rank: list[dict[str, dict[Any, float]]]) -> float | None:
    """Mean over stages of (B + W) / F from op times per rank and stage; None without a split backward."""
    ratios = [
        (times["B"][s] + times["W"][s]) / times["F"][s]
        for times in per_rank
        if "B" in times and "W" in times
        for s in times["B"]
        if s in times["W"] and s in times.get("F", {})
    ]
    return sum(ratios) / len(ratios) if ratios else None


def _in_run_split_rows(cases: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for c in cases:
        if "traces" not in c:
            continue
        ours = _backward_over_forward([t["op_times_s"] for t in c["traces"]])
        theirs = _backward_over_forward(c.get("torch_op_times", []))
        if ours is not None or theirs is not None:
            cells = ["-" if x is None else f"{x:.2f}" for x in (ours, theirs)]
            rows.append([c["schedule"], c["peer"], str(c["p"]), c["size"], *cells])
    return rows


def _split_rows(split: dict[str, dict[str, Any]]) -> list[list[str]]:
    rows = []
    for size, measured in split.items():
        for chunk in ("megatron", "plain"):
            t = measured[chunk]
            ours = f"{(t['ours B'] + t['ours W']) / t['BW']:.2f}" if "ours B" in t else "-"
            rows.append([size, chunk, str(measured["layers"])] + [f"{t[k] * 1e3:.1f}" for k in ("F", "BW")])
            rows[-1] += [f"{t['torch B'] * 1e3:.1f}", f"{t['torch W'] * 1e3:.1f}"]
            rows[-1] += [f"{(t['torch B'] + t['torch W']) / t['BW']:.2f}", ours]
    return rows


def report(settings: Any, cases: list[dict[str, Any]], split: dict[str, dict[str, Any]]) -> str:
    sizes = "; ".join(describe(name) for name in settings.sizes)
    timed = ", ".join(
        f"{iterations_of(size, settings.iterations, settings.warmup) - settings.warmup} ({size})"
        for size in settings.sizes
    )
    lines = [
        f"## Peers on real compute, p = {', '.join(map(str, settings.ps))}: torch.distributed.pipelining's and "
        "megatron-core's runtimes vs ours",
        "",
        f"Command: `{settings.command}` (m = 2p; {timed} timed iterations after {settings.warmup} warm-up, "
        "medians of the slowest rank per iteration; fp32, one thread per rank, gloo; "
        f"{sizes}).",
        "",
        "Ours / peer: wall time per iteration, same chunks, weights, data and micro-batch order, alternating which "
        "runs first: the median of the per-iteration ratios and, in brackets, their quartiles (the middle half of the"
        " iterations; where they straddle 1.000 the run does not tell the two runtimes apart). Loss diff: max "
        "relative difference of every micro-batch loss, ours against our 1f1b, the peer's against ours. Gains are "
        "over our 1f1b, which every case runs in the same rotation of iterations on chunks of its own placement (same"
        " weights): measured gain = median (quartiles) over iterations of our 1f1b's time / ours (paired, so the "
        "drift of the machine's speed between cases stays out); simulated gain = the ratio of the two plans from the "
        "op times and host costs (bookkeeping per op, posting per exchange) that traced iterations of each, "
        "alternating, measured; measured / simulated: ours against its own plan; realized share = (measured gain - 1)"
        " / (simulated gain - 1) (n/a: simulated gain below 1.01, no improvement to realize). Peer on plain layers: "
        "torch's split schedules on chunks of plain torch layers of the same shapes (bench/plain_chunks.py; "
        "its generic backward split is free there, on megatron's custom autograd functions it is not: the split table"
        " below), own weights, so its losses are not compared.",
        "",
    ]
    header = ["ours", "peer", "p", "size", "ours ms", "peer ms", "peer on plain layers ms", "ours / peer"]
    header += ["loss diff, ours", "loss diff, peer"]
    header += ["our 1f1b in the same run ms", "measured / simulated", "simulated gain", "measured gain"]
    header += ["ratio of gains", "realized share"]
    lines += _table(header, _peer_rows(cases))
    lines += ["", "Host time of ours between ops, per rank (µs), from the traced iterations:", ""]
    header = ["schedule", "p", "size", "ops per rank", "bookkeeping per op", "posting per exchange (median)"]
    header += ["p2p wait per op", "megatron forward-step wrapper per F"]
    lines += _table(header, _host_rows(cases))
    lines += ["", "Split backward in the pipelined runs: (B + W) / F per stage, mean over stages and ranks:", ""]
    lines += _table(["schedule", "peer", "p", "size", "ours", "peer"], _in_run_split_rows(cases))
    lines += ["", "Split backward on one middle stage (ms, medians; ratios: split B + W over the fused BW):", ""]
    header = ["size", "chunk", "layers", "F", "BW", "torch B", "torch W", "torch (B+W)/BW", "ours (B+W)/BW"]
    lines += _table(header, _split_rows(split))
    return "\n".join(lines)
