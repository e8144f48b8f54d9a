"""The report of ``megatron-pp bench --emulate`` (markdown, printed and optionally written into a results
file) and its picture: measured vs simulated gain over 1f1b per schedule."""

from __future__ import annotations

import os
from pathlib import Path

from .emulate_results import BASELINE, BLOCK, P2P_ROUNDS, SECTION, Outcome, Row, Settings
from .realized import realized_text
from .results_file import block_markers, replace_block

INTRO = (
    "Every registered schedule that builds at (p, m) on p spawned gloo ranks: real megatron-core GPTModel chunks "
    "(one layer per stage, tied embeddings), megatron DDP, real tensors through our executor's p2p, and every F, B, "
    "W and BW op padded with sleep to a fixed wall time, so the CPU is mostly idle and the time shows the "
    "runtime's own behaviour. megatron-core's own 1F1B and interleaved 1F1B run on the same ranks with the same "
    "pads (their `forward_step` / `backward_step` padded), alternating iterations with ours. The simulator gets "
    "the same per-stage costs and the measured one-way p2p time. Written by `megatron-pp bench --emulate --write`; "
    "each block below is replaced when its command is run again."
)


def _f(x: float, digits: int = 3) -> str:
    return "-" if x != x else f"{x:.{digits}f}"  # NaN: not measured


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def report(outcome: Outcome, figure_link: str | None = None) -> str:
    """Markdown: the settings, one row per schedule, megatron-core's schedules, the pad check and the
    per-rank breakdown of where the time went. Long because the report reads top to bottom as printed: each
    section is a few lines of formatting in the order of the output."""
    s = outcome.settings
    comm = (
        f"{outcome.comm_ms:.3f} ms one way (measured: median of {P2P_ROUNDS} round trips; fastest "
        f"{outcome.comm_fastest_ms:.3f} ms)"
        if outcome.comm_fastest_ms is not None
        else f"{outcome.comm_ms:g} ms (given)"
    )
    lines = [
        f"Command: `{s.command}`",
        "",
        f"Pads per 1F1B stage: T_F = {s.t_f:g} ms, T_B = {s.t_b:g} ms, T_W = {s.t_w:g} ms, BW = B + W (a rank holding "
        f"k stages per replica pads each op to 1/k of these){_a2a_text(s)}; simulator hop time {comm}. "
        f"Measured: the slowest rank's forward-backward call per iteration (all ranks start it after a barrier), "
        f"median of "
        f"{s.iterations} iterations after {s.warmup} warm-up. Machine: {os.cpu_count()} CPUs, 1-minute load "
        f"average {outcome.load[0]:.1f} at the start and {outcome.load[1]:.1f} at the end"
        f"{' (shared with other work: loaded)' if max(outcome.load) > (os.cpu_count() or 1) else ''}; "
        f"{outcome.seconds:.0f} s in all.",
        "",
    ]
    if outcome.paid_hop_ms is not None:
        hop, count = outcome.paid_hop_ms
        lines[-1:-1] = [
            "",
            f"Hop time the {BASELINE} run paid: {hop:.3f} ms (median over its {count} messages whose consumer "
            "waited for them, producer op's end to consumer op's start: the transport plus posting, waking and "
            "the runtime's bookkeeping on both sides). 'simulated (paid hop)' re-simulates every schedule with it; "
            "'host' also charges each schedule's own run's host time per op (between ops) and per sending op "
            "(posting), analysis/host_costs.py (not for overlapped runs, whose pairs are host time there).",
        ]
    header = [
        "schedule",
        "v",
        "simulated ms",
        "measured ms",
        "measured / simulated",
        "measured / simulated (paid hop)",
        "measured / simulated (host)",
        "simulated gain vs 1f1b",
        "measured gain vs 1f1b",
        "measured gain / simulated gain",
        "realized share",
        "realized share (host)",
        "ops over pad",
    ]
    base = next((r for r in outcome.rows if r.name == BASELINE and not r.overlap), None)
    rows = [
        [
            r.label,
            str(r.v),
            _f(r.simulated, 1),
            _f(r.measured, 1),
            _f(r.ratio),
            _f(r.ratio_paid_hop),
            _f(r.ratio_host),
            _f(r.sim_gain),
            _f(r.measured_gain),
            _f(r.measured_gain / r.sim_gain),
            realized_text(r.measured_gain, r.sim_gain),
            realized_text(r.measured_gain, base.simulated_host / r.simulated_host)
            if base is not None and r.simulated_host > 0 and base.simulated_host > 0
            else "-",
            f"{r.over_pad}/{r.ops}",
        ]
        for r in outcome.rows
    ]
    lines += _table(header, rows)
    natives = [r for r in outcome.rows if r.native is not None]
    if natives:
        lines += ["", "Against megatron-core's own schedules (same ranks, model and pads; alternating iterations):", ""]
        header = [
            "ours",
            "megatron ms",
            "ours ms",
            "ours / megatron (median per iteration)",
            "megatron / simulated",
            "megatron's ops over pad",
        ]
        rows = [
            [
                r.label,
                _f(r.native_measured, 1),
                _f(r.measured, 1),
                _f(r.ours_vs_native),
                _f(r.native_measured / r.simulated),
                f"{r.native_over_pad}/{r.native_ops}",
            ]
            for r in natives
        ]
        lines += _table(header, rows)
    lines += overlap_lines(outcome.rows)
    lines += ["", *pad_lines(outcome.rows)]
    if figure_link:
        what = "time per iteration without and with overlap" if s.overlap else "measured vs simulated gain"
        lines += ["", f"![{what}, p={s.p} m={s.m}]({figure_link})"]
    lines += ["", *breakdown_lines(outcome.rows)]
    if outcome.skipped:
        lines += ["", "Not applicable at this (p, m): " + "; ".join(f"{k} ({v})" for k, v in outcome.skipped.items())]
    return "\n".join(lines)


def without_and_with(rows: list[Row]) -> list[tuple[Row, Row]]:
    """``(without overlap, with overlap)`` for each schedule run both ways, in the order of the runs."""
    without = {r.name: r for r in rows if not r.overlap}
    return [(without[r.name], r) for r in rows if r.overlap and r.name in without]


def overlap_lines(rows: list[Row]) -> list[str]:
    """Each schedule without and with the all-to-all overlap side by side, and where the padded all-to-alls
    ran (empty without the overlap run)."""
    pairs = without_and_with(rows)
    if not pairs:
        return []
    header = [
        "schedule",
        "without ms",
        "with ms",
        "measured gain",
        "simulated gain",
        "measured / simulated gain",
        "realized share",
    ]
    table = [
        [
            off.name,
            _f(off.measured, 1),
            _f(on.measured, 1),
            _f(off.measured / on.measured),
            _f(off.simulated / on.simulated),
            _f((off.measured / on.measured) / (off.simulated / on.simulated)),
            realized_text(off.measured / on.measured, off.simulated / on.simulated),
        ]
        for off, on in pairs
    ]
    where = ", ".join(f"{r.label} {r.a2a_on_worker[0]}/{r.a2a_on_worker[1]}" for r in rows if r.a2a_on_worker[1])
    return [
        "",
        "All-to-all overlap (megatron's combined step; gain = time without / time with):",
        "",
        *_table(header, table),
        "",
        f"Padded all-to-alls that ran on the CPU communication stream's worker, of all (all ranks and iterations): "
        f"{where}.",
    ]


def pad_lines(rows: list[Row]) -> list[str]:
    """Every op lasted at least its pad (by construction; counted), and the real compute under it."""
    ops = sum(r.ops for r in rows)
    short = sum(r.short_ops for r in rows)
    native_ops = sum(r.native_ops for r in rows)
    native_short = sum(r.native_short_ops for r in rows)
    real: dict[str, list[float]] = {}  # per kind: the rows' medians and maxima
    for r in rows:
        for kind, pair in (*r.real_ms.items(), *(("megatron " + k, v) for k, v in r.native_real_ms.items())):
            real.setdefault(kind, []).extend(pair)
    medians = {kind: sorted(values[0::2])[len(values[0::2]) // 2] for kind, values in real.items()}
    lines = [
        f"Pads: {ops - short} of {ops} of our ops and {native_ops - native_short} of {native_ops} of megatron's "
        "(timed iterations) lasted at least their pad. Real compute of one op before padding, ms (median over "
        "schedules of each schedule's median / largest of all): "
        + ", ".join(f"{kind} {medians[kind]:.2f} / {max(values[1::2]):.2f}" for kind, values in sorted(real.items()))
        + "."
    ]
    over = [r for r in rows if r.over_pad or r.native_over_pad]
    if over:
        count = sum(r.over_pad + r.native_over_pad for r in over)
        lines.append(
            f"**WARNING** the real compute of {count} of {ops + native_ops} ops exceeded their pad ("
            + ", ".join(r.label for r in over)
            + "; column 'ops over pad'): those ops measured the CPU, not the emulated costs; rerun on a quieter "
            "machine or with larger --costs."
        )
    if short or native_short:
        lines.append(f"**WARNING** {short + native_short} ops ended before their pad: the padding is broken.")
    return lines


def breakdown_lines(rows: list[Row]) -> list[str]:
    """Where each rank's iteration went, from the tracer (ms, medians over the timed iterations)."""
    header = [
        "schedule",
        "rank",
        "compute",
        "real compute",
        "wait F",
        "wait B",
        "wait BW",
        "wait W",
        "p2p post",
        "recv wait",
        "send wait",
        "between ops",
        "drain",
        "outside loop",
        "idle",
        "longest wait (op ms)",
    ]
    keys = ["compute", "real_compute", "wait_F", "wait_B", "wait_BW", "wait_W", "post", "recv_wait", "send_wait"]
    keys += ["between", "drain", "outside"]
    table = [
        [r.label, str(b["rank"]), *(_f(b[k], 1) for k in keys), _f(b["idle"], 1), b["longest_wait"]]
        for r in rows
        for b in r.ranks
    ]
    return [
        "<details><summary>Where each rank's time went (ms per iteration, medians; from the tracer)</summary>",
        "",
        "compute: the ops, padded; wait X: before the rank's X ops, from the end of what it did last (the "
        "op's input receive, for a backward also its output's send); p2p post: inside the executor's posting "
        "of exchanges; recv / send wait: up to a receive or send wait that blocked, where the executor reports "
        "its p2p protocol's events to the tracer (else those waits are in wait X); between ops: other time "
        "between ops (bookkeeping, collective launches); drain: after "
        "the last op until the executor's loop ends (pending sends, collectives); outside loop: the rest of the "
        "forward-backward call (megatron's finalize_model_grads: the tied embedding's all-reduce); idle: all "
        "but compute.",
        "",
        *_table(header, table),
        "",
        "</details>",
    ]


def draw(outcome: Outcome, directory: str) -> Path:
    """The picture: measured vs simulated gain over 1f1b per schedule (PNG in ``directory``); with the
    all-to-all overlap, each schedule's measured time without and with it, megatron's beside."""
    from ..analysis.plot import draw_gain_comparison

    if any(r.overlap for r in outcome.rows):
        return _draw_overlap(outcome, directory)
    rows = [r for r in outcome.rows if r.sim_gain == r.sim_gain]
    s = outcome.settings
    return draw_gain_comparison(
        [r.label for r in rows],
        [r.sim_gain for r in rows],
        [r.measured_gain for r in rows],
        Path(directory) / f"emulated_gain_p{s.p}_m{s.m}.png",
        f"emulated compute on {s.p} gloo ranks, m={s.m}: gain over {BASELINE}",
        BASELINE,
    )


def _draw_overlap(outcome: Outcome, directory: str) -> Path:
    from ..analysis.plot import draw_times_with_without

    s = outcome.settings
    pairs = without_and_with(outcome.rows)
    bars = {
        "ours, without overlap": [off.measured for off, _ in pairs],
        "ours, with overlap": [on.measured for _, on in pairs],
        "simulated, with overlap": [on.simulated for _, on in pairs],
        "megatron's own, with overlap": [on.native_measured if on.native else float("nan") for _, on in pairs],
    }
    return draw_times_with_without(
        [off.name for off, _ in pairs],
        bars,
        Path(directory) / f"emulated_overlap_p{s.p}_m{s.m}_a2a{s.a2a_ms:g}ms_x{s.moe_layers}.png",
        f"MoE all-to-all overlap on {2 * s.p} gloo ranks (EP 2), p={s.p} m={s.m}: time per iteration",
    )


def block_name(settings: Settings) -> str:
    """The results file's block of one pipeline shape and all-to-all setting, nested in the section's block."""
    return f"{BLOCK} p={settings.p} m={settings.m}{_a2a_tag(settings)}"


def _a2a_tag(settings: Settings) -> str:
    """The all-to-all settings in a block's name and heading (empty without ``--a2a-ms``)."""
    if not settings.moe_layers:
        return ""
    return f" a2a={settings.a2a_ms:g}ms x{settings.moe_layers}" + (" overlap" if settings.overlap else "")


def write_block(path: str, settings: Settings, text: str) -> None:
    """Put ``text`` into ``path``'s emulated-compute section as the block of ``(p, m)``: replace that
    block if present, else add it at the end of the section (which is appended if missing)."""
    target = Path(path)
    old = target.read_text() if target.exists() else ""
    if block_markers(BLOCK)[0] not in old:
        old = replace_block(old, BLOCK, f"## {SECTION}\n\n{INTRO}")
    body = f"### p = {settings.p}, m = {settings.m}{_a2a_tag(settings).replace(' a2a=', ', a2a = ')}\n\n{text}"
    target.write_text(replace_block(old, block_name(settings), body, inside=BLOCK))


def _a2a_text(settings: Settings) -> str:
    """The all-to-all pad, in words (empty without ``--a2a-ms``)."""
    if not settings.moe_layers:
        return ""
    t, n = settings.a2a_ms, settings.moe_layers
    if settings.overlap:
        return (
            f"; MoE all-to-alls: a tiny MoE GPT ({n} MoE layer(s) per 1F1B stage) at EP = 2 on {settings.ranks} "
            f"ranks, every dispatch and combine all-to-all padded to at least {t:g} ms (1/k on a rank holding k "
            "stages) where it runs: inline without overlap (F, B and BW floors include them), on the CPU "
            "communication stream's worker with overlap (compute then padded node by node, each attention and "
            "experts node to its op's compute / 2 per layer); simulated with the CPU launch model"
        )
    return (
        f"; MoE all-to-alls: {t:g} ms each, {n} MoE layer(s) per 1F1B stage, not overlapped: F, B and BW "
        f"padded {2 * n * t:g} ms longer, and simulated so"
    )
