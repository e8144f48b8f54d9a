"""Gantt charts of simulated schedules, and a bar chart of simulated vs measured gains (matplotlib,
imported lazily; no pyplot, no global backend).

One lane per rank (rank 0 on top); each op is a box coloured by kind (F, B, W, BW), a lighter
shade per later chunk when a rank holds several chunks, labelled with its micro-batch. Idle
time stays blank. The output format follows the file suffix (``.png`` or ``.svg``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..schedules.ir import Op, OpKind
from ..schedules.schedule import Schedule

if TYPE_CHECKING:
    from .simulate import SimResult

FORMATS = (".png", ".svg")
KIND_COLORS: dict[OpKind, str] = {
    OpKind.F: "#1f77b4",  # blue
    OpKind.B: "#ff7f0e",  # orange
    OpKind.W: "#2ca02c",  # green
    OpKind.BW: "#9467bd",  # purple
}
_MAX_LIGHTEN = 0.6  # how close to white the last chunk's shade gets


def shade(kind: OpKind, chunk: int, num_chunks: int) -> tuple[float, float, float]:
    """RGB colour of an op: the kind's colour, lightened towards white for later chunks."""
    hex_color = KIND_COLORS[kind].lstrip("#")
    rgb = [int(hex_color[i : i + 2], 16) / 255 for i in (0, 2, 4)]
    amount = _MAX_LIGHTEN * chunk / (num_chunks - 1) if num_chunks > 1 else 0.0
    r, g, b = (c + (1.0 - c) * amount for c in rgb)
    return (r, g, b)


def _text_color(rgb: Sequence[float]) -> str:
    luminance = 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2]
    return "black" if luminance > 0.6 else "white"


def title_for(result: SimResult, schedule: Schedule) -> str:
    peak = max(result.peak_activations, default=0)
    peak_1f1b = max(result.peak_activations_1f1b_units, default=0)
    return (
        f"{schedule.name}: p={schedule.num_ranks} m={schedule.num_microbatches} v={schedule.chunks_per_rank}  |  "
        f"bubble {result.bubble_rate:.2%} (sync {result.sync_bubble_rate:.2%})  |  "
        f"peak activations {peak:g} stage units = {peak_1f1b:g} 1F1B units (worst rank)"
    )


_Colour = tuple[float, float, float]
#: micro-batch labels drawn at most (more: none; each is a separate text, the costly part of a large chart)
MAX_LABELS = 2000


def _output_path(path: str | Path) -> Path:
    """``path`` as a Path, refused unless it names a format we draw (.png, .svg)."""
    out = Path(path)
    if out.suffix.lower() not in FORMATS:
        raise ValueError(f"cannot draw to {out.name!r}: the file name must end in .png or .svg")
    return out


def _new_figure(width: float, height: float, dpi: int = 100) -> Any:
    """A matplotlib ``Figure`` (constrained layout); ValueError naming the extra when matplotlib is missing."""
    try:
        from matplotlib.figure import Figure
    except ImportError:  # pragma: no cover - depends on the environment
        raise ValueError("drawing needs matplotlib: pip install 'megatron_pp_ext[plot]'") from None
    return Figure(figsize=(width, height), dpi=dpi, layout="constrained")


def _save(fig: Any, out: Path) -> Path:
    """Write ``fig`` to ``out`` in the format its suffix names, creating the folder."""
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, format=out.suffix.lower().lstrip("."))
    return out


def draw(result: SimResult, schedule: Schedule, path: str | Path) -> Path:
    """Write a Gantt chart of ``result`` (simulated from ``schedule``) to ``path`` (.png or .svg)."""
    out = _output_path(path)
    fig_height = 0.5 * schedule.num_ranks + 2.0
    ops_per_rank = max((len(row) for row in schedule.ops), default=1)
    width = min(max(10.0, 0.3 * ops_per_rank + 3.0), 48.0)
    fig = _new_figure(width, fig_height, dpi=110)
    from matplotlib.patches import Patch

    p = schedule.num_ranks
    chunks = schedule.chunks_per_rank
    makespan = max(result.makespan, max((end for _, _, _, end in result.timeline), default=0.0), 1e-9)
    ax = fig.add_subplot()

    # Label font: fit a short number into a typical box (axes take roughly 90% of the width).
    pt_per_time = 0.9 * width * 72 / makespan
    durations = sorted(end - start for _, _, start, end in result.timeline if end > start)
    typical = durations[len(durations) // 4] if durations else 1.0
    fontsize = max(4.0, min(9.0, typical * pt_per_time / 1.8))

    used: set[tuple[OpKind, int]] = set()
    for rank in range(p):
        ax.axhspan(rank - 0.42, rank + 0.42, color="#f2f2f2", zorder=0, linewidth=0)
    boxes: dict[tuple[int, _Colour], list[tuple[float, float]]] = {}  # one collection per rank and colour, not per op
    labels: list[tuple[float, int, str, _Colour]] = []
    for rank, op_text, start, end in result.timeline:
        op = Op.parse(op_text)
        chunk = schedule.placement.chunk_of(op.stage) if op.stage < schedule.num_stages else 0
        color = shade(op.kind, chunk, chunks)
        used.add((op.kind, chunk))
        boxes.setdefault((rank, color), []).append((start, end - start))
        label = str(op.microbatch)
        if (end - start) * pt_per_time >= fontsize * 0.62 * len(label) + 2:
            labels.append(((start + end) / 2, rank, label, color))

    for (rank, face), spans in boxes.items():
        ax.broken_barh(spans, (rank - 0.4, 0.8), facecolors=face, edgecolor="white", linewidth=0.6, zorder=2)
    if len(labels) > MAX_LABELS:  # each text is drawn on its own: thousands take minutes, and are not readable
        labels = []
    for x, rank, label, face in labels:
        ax.text(x, rank, label, ha="center", va="center", fontsize=fontsize, color=_text_color(face), zorder=3)
    ax.set_ylim(p - 0.5, -0.5)
    ax.set_yticks(range(p))
    ax.set_yticklabels([f"rank {r}" for r in range(p)])
    ax.set_xlim(0, makespan)
    ax.set_xlabel(
        "time (cost units); "
        + ("box label = micro-batch" if labels else f"micro-batch labels left out (over {MAX_LABELS} boxes)")
        + ("; lighter shade = later chunk" if chunks > 1 else "")
    )
    ax.set_title(title_for(result, schedule), fontsize=10)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)

    handles = [
        Patch(color=shade(kind, chunk, chunks), label=kind.value if chunks == 1 else f"{kind.value} chunk {chunk}")
        for kind in OpKind
        for chunk in range(chunks)
        if (kind, chunk) in used
    ]
    if handles:
        fig.legend(handles=handles, loc="outside lower center", ncol=min(len(handles), 8), fontsize=8, frameon=False)
    return _save(fig, out)


def draw_plan_vs_measured(
    result: SimResult,
    schedule: Schedule,
    measured: Sequence[tuple[int, str, float, float]],
    path: str | Path,
    unit: str = "s",
    plan_unit: str = "cost units",
) -> Path:
    """Two Gantt charts on one page: the simulated plan (top) and a measured trace of the same schedule
    (bottom, ``(rank, op, start, end)`` in ``unit`` from the trace's first op), each on its own time axis."""
    out = _output_path(path)
    p, chunks = schedule.num_ranks, schedule.chunks_per_rank
    fig = _new_figure(14, 1.0 * p + 3)
    panels = (
        ("plan (simulator)", list(result.timeline), plan_unit),
        ("measured (one traced iteration)", list(measured), unit),
    )
    for i, (label, timeline, axis_unit) in enumerate(panels):
        ax = fig.add_subplot(2, 1, i + 1)
        for rank, op_text, start, end in timeline:
            op = Op.parse(op_text)
            color = shade(op.kind, schedule.placement.chunk_of(op.stage), chunks)
            ax.barh(rank, end - start, left=start, height=0.8, color=color, edgecolor="white", linewidth=0.4)
        ax.set_ylim(p - 0.5, -0.5)
        ax.set_yticks(range(p))
        ax.set_yticklabels([f"rank {r}" for r in range(p)])
        ax.set_xlim(0, max((end for *_, end in timeline), default=1.0))
        ax.set_xlabel(f"time ({axis_unit})")
        ax.set_title(f"{schedule.name} p={p} m={schedule.num_microbatches}: {label}", fontsize=10)
    return _save(fig, out)


def draw_gain_comparison(
    names: Sequence[str],
    simulated: Sequence[float],
    measured: Sequence[float],
    path: str | Path,
    title: str,
    baseline: str = "1f1b",
) -> Path:
    """Grouped bars per schedule: its simulated and its measured gain over ``baseline`` (1.0 = as fast as
    the baseline, drawn as a line), so a schedule whose real run loses what the simulator promises stands out."""
    out = _output_path(path)
    fig = _new_figure(max(6.0, 0.7 * len(names) + 2), 4.2)
    ax = fig.add_subplot(1, 1, 1)
    xs = range(len(names))
    width = 0.38
    ax.bar([x - width / 2 for x in xs], simulated, width, label="simulated", color="#9ecae1")
    ax.bar([x + width / 2 for x in xs], measured, width, label="measured", color="#3182bd")
    ax.axhline(1.0, color="black", linewidth=0.8)
    values = [*simulated, *measured, 1.0]
    ax.set_ylim(min(values) - 0.05, max(values) + 0.05)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(names, rotation=35, ha="right", fontsize=8)
    ax.set_ylabel(f"gain over {baseline} (time of {baseline} / time)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, frameon=False)
    return _save(fig, out)


def draw_times_with_without(
    names: Sequence[str],
    bars: Mapping[str, Sequence[float]],
    path: str | Path,
    title: str,
    unit: str = "ms",
) -> Path:
    """Grouped bars per schedule, one bar per entry of ``bars`` (``label -> value per schedule``, NaN for a
    schedule without that bar): e.g. the iteration time without overlap, with it, and a peer's beside."""
    out = _output_path(path)
    fig = _new_figure(max(6.0, 1.1 * len(names) + 2), 4.2)
    ax = fig.add_subplot(1, 1, 1)
    width = 0.8 / max(len(bars), 1)
    colors = ("#9ecae1", "#3182bd", "#e6550d", "#fdae6b", "#31a354")
    for k, (label, values) in enumerate(bars.items()):
        xs = [x - 0.4 + width * (k + 0.5) for x in range(len(names))]
        ax.bar(xs, values, width, label=label, color=colors[k % len(colors)])
    ax.set_xticks(list(range(len(names))))
    ax.set_xticklabels(names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel(f"time per iteration ({unit})")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, frameon=False, loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=len(bars))
    return _save(fig, out)


def draw_rank_busy(
    panels: Mapping[str, Mapping[str, tuple[Sequence[float], Sequence[float]]]],
    path: str | Path,
    title: str,
    unit: str = "ms",
) -> Path:
    """One panel per schedule, grouped bars per rank: each layout's measured busy time (``panels[schedule]
    [layout] = (measured per rank, predicted per rank)``) with its predicted time as a black tick, so a layout
    that evens out the ranks, and how far the prediction is off, show at a glance."""
    out = _output_path(path)
    fig = _new_figure(4.0 * max(1, len(panels)), 4.0)
    colors = ("#bdbdbd", "#3182bd", "#e6550d", "#31a354")
    for i, (name, layouts) in enumerate(panels.items()):
        ax = fig.add_subplot(1, len(panels), i + 1)
        width = 0.8 / max(1, len(layouts))
        for j, (label, (measured, predicted)) in enumerate(layouts.items()):
            xs = [r - 0.4 + width * (j + 0.5) for r in range(len(measured))]
            bars = ax.bar(xs, measured, width, label=label, color=colors[j % len(colors)])
            for rank, rect in enumerate(bars):  # named in an SVG: busy-PANEL-LAYOUT-RANK
                rect.set_gid(f"busy-{i}-{j}-{rank}")
            ax.scatter(xs, predicted, marker="_", s=400, color="black", zorder=3)
        ranks = max((len(m) for m, _ in layouts.values()), default=0)
        ax.set_xticks(range(ranks))
        ax.set_xticklabels([f"rank {r}" for r in range(ranks)])
        ax.set_ylabel(f"busy time per iteration ({unit})")
        ax.set_title(name, fontsize=10)
        top = max((max([*m, *p]) for m, p in layouts.values() if len(m) or len(p)), default=1.0)
        ax.set_ylim(0, 1.3 * top)  # room for the legend above the bars
        ax.legend(fontsize=7, frameon=False, loc="upper center", ncol=1)
    fig.suptitle(title, fontsize=10)
    return _save(fig, out)
