"""Peer comparison in the simulator: torch.distributed.pipelining's schedules next to ours.

Every torch schedule of :data:`~megatron_pp_ext.analysis.torch_orders.TORCH_SCHEDULES` is imported
from its own ``pipeline_order``, validated by our validator and simulated by our simulator with the
same costs as its counterparts of our registry. Cost units: a rank holds the same layers in every
schedule, so a stage of a ``v``-chunk schedule (looped with ``v`` chunks, or V-shape with 2) holds
``1/v`` of a rank's layers and costs ``T_F/v``, ``T_B/v``, ``T_W/v``; one hop costs ``T_comm``
whatever the chunk size. Makespans are thus comparable across chunkings. Peak activation memory
is in units of one 1F1B stage's activation for one micro-batch (``M_a``), counted from F until the
last backward op (W or BW) ends, the simulator's default.

"Torch better": a torch order with a shorter makespan than every one of its counterparts at the
same (p, m, costs) (tolerance 1e-9 relative), or the same makespan with a lower peak memory. Both
are listed by :func:`torch_better`, never filtered.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from ..schedules import registry
from ..schedules.costs import Costs
from ..schedules.ir import ScheduleError
from ..schedules.schedule import Schedule
from .schedule_check import validate
from .simulate import SimResult, simulate
from .torch_orders import TORCH_SCHEDULES, import_torch_schedule

#: Cost models: name -> (T_F, T_B, T_W, T_comm) for one 1F1B stage (L/p layers).
COST_MODELS: dict[str, tuple[float, float, float, float]] = {
    "unit": (1.0, 1.0, 1.0, 0.0),
    # benchmarks/bench_zero_bubble.py's unequal costs (profiled ratios of the zero-bubble paper's runs)
    "profiled": (1.0, 1.1, 0.6, 0.05),
}

#: Our counterparts that take extra keywords; v = chunks per rank where the schedule takes it.
_OURS_KWARGS: dict[str, dict[str, object]] = {
    "interleaved-1f1b": {"v": 2},
    "bfs": {"v": 2},
    "bfs-zb": {"v": 2},
    "interleaved-zb": {"v": 2},
}
_COST_AWARE = ("zb-auto", "v-zb", "bfs-zb", "interleaved-zb")


@dataclass(frozen=True)
class PeerRow:
    p: int
    m: int
    costs: str
    torch_name: str  # the torch schedule this row belongs to
    schedule: str  # "torch:<name>" or our registry name (+ memory limit)
    side: str  # "torch" or "ours"
    makespan: float | None
    bubble_rate: float | None
    sync_bubble_rate: float | None
    peak_m_a: float | None  # worst rank, units of M_a
    p2p_messages: int | None
    note: str = ""
    peak_per_rank: tuple[float, ...] = ()  # units of M_a

    @property
    def ok(self) -> bool:
        return self.makespan is not None


def stage_costs(model: str, chunks: int) -> Costs:
    """The costs of one stage of a schedule with ``chunks`` stages per rank (see the module doc)."""
    f, b, w, comm = COST_MODELS[model]
    return Costs(f / chunks, b / chunks, w / chunks, None, comm)


def _chunks(schedule: Schedule) -> int:
    return max(1, round(schedule.placement.stages_per_rank_per_replica))


def _row(p: int, m: int, model: str, torch_name: str, name: str, side: str, schedule: Schedule) -> PeerRow:
    costs = stage_costs(model, _chunks(schedule))
    result: SimResult = simulate(schedule, costs, lowered=validate(schedule))
    return PeerRow(
        p,
        m,
        model,
        torch_name,
        name,
        side,
        result.makespan,
        result.bubble_rate,
        result.sync_bubble_rate,
        max(result.peak_activations_1f1b_units),
        result.p2p_messages,
        peak_per_rank=tuple(result.peak_activations_1f1b_units),
    )


def _failed(p: int, m: int, model: str, torch_name: str, name: str, side: str, why: str) -> PeerRow:
    return PeerRow(p, m, model, torch_name, name, side, None, None, None, None, None, why)


def ours(name: str, p: int, m: int, model: str, memory_limit: int | None = None) -> Schedule:
    kwargs = dict(_OURS_KWARGS.get(name, {}))
    if name in _COST_AWARE:
        chunks = 2 if name in ("v-zb", "bfs-zb", "interleaved-zb") else 1
        kwargs["costs"] = stage_costs(model, chunks)
    if memory_limit is not None:
        kwargs["memory_limit"] = memory_limit
    return registry.generate(name, p, m, **kwargs)


def _our_variants(name: str, p: int) -> list[tuple[str, int | None]]:
    if name == "zb-auto":  # default limit 2p, and p (1F1B's memory, like torch's zero-bubble orders)
        return [("zb-auto (2p)", None), ("zb-auto (p)", p)]
    return [(name, None)]


def rows_for(p: int, m: int, model: str, torch_names: Iterable[str] | None = None) -> list[PeerRow]:
    """Every torch schedule and its counterparts at one shape and cost model."""
    known = set(registry.names())
    out: list[PeerRow] = []
    for torch_name in torch_names or TORCH_SCHEDULES:
        info = TORCH_SCHEDULES[torch_name]
        try:
            imported = import_torch_schedule(torch_name, p, m)
            note = f"repaired F numbering on rank(s) {list(imported.repaired_ranks)}" if imported.repaired_ranks else ""
            row = _row(p, m, model, torch_name, f"torch:{torch_name}", "torch", imported.schedule)
            out.append(replace(row, note=note))
        except (ScheduleError, ValueError, RuntimeError, AssertionError) as exc:
            out.append(_failed(p, m, model, torch_name, f"torch:{torch_name}", "torch", _short(exc)))
        for name in info.counterparts:
            if name not in known:
                out.append(_failed(p, m, model, torch_name, name, "ours", "not in our registry"))
                continue
            for label, limit in _our_variants(name, p):
                try:
                    out.append(_row(p, m, model, torch_name, label, "ours", ours(name, p, m, model, limit)))
                except (ScheduleError, ValueError) as exc:
                    out.append(_failed(p, m, model, torch_name, label, "ours", _short(exc)))
    return out


def _short(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:120]


def torch_better(rows: Sequence[PeerRow], tol: float = 1e-9) -> list[tuple[PeerRow, PeerRow, str]]:
    """``(torch row, our best counterpart, why)`` wherever torch's order beats every counterpart."""
    found = []
    groups: dict[tuple[int, int, str, str], list[PeerRow]] = {}
    for row in rows:
        groups.setdefault((row.p, row.m, row.costs, row.torch_name), []).append(row)
    for group in groups.values():
        theirs = [r for r in group if r.side == "torch" and r.ok]
        mine = [r for r in group if r.side == "ours" and r.ok]
        if not theirs or not mine:
            continue
        t = theirs[0]
        assert t.makespan is not None and t.peak_m_a is not None
        best = min(mine, key=lambda r: (r.makespan, r.peak_m_a))
        assert best.makespan is not None and best.peak_m_a is not None
        if t.makespan < best.makespan * (1 - tol):
            found.append((t, best, f"makespan {t.makespan:.4g} < {best.makespan:.4g}"))
        elif abs(t.makespan - best.makespan) <= tol * best.makespan and t.peak_m_a < best.peak_m_a - 1e-9:
            found.append((t, best, f"same makespan, peak {t.peak_m_a:g} < {best.peak_m_a:g} M_a"))
    return found


def _fmt(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def markdown_table(rows: Sequence[PeerRow]) -> str:
    header = ["p", "m", "torch schedule", "schedule", "makespan", "bubble", "sync bubble", "peak (M_a)", "p2p", "note"]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        cells = [
            str(r.p),
            str(r.m),
            r.torch_name,
            f"**{r.schedule}**" if r.side == "torch" else r.schedule,
            _fmt(r.makespan, ".3f"),
            _fmt(r.bubble_rate, ".4f"),
            _fmt(r.sync_bubble_rate, ".4f"),
            _fmt(r.peak_m_a, "g"),
            "n/a" if r.p2p_messages is None else str(r.p2p_messages),
            r.note,
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def better_table(found: Sequence[tuple[PeerRow, PeerRow, str]]) -> str:
    if not found:
        return "(none)"
    lines = [
        "| costs | p | m | torch schedule | our best counterpart | why |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for t, best, why in found:
        lines.append(f"| {t.costs} | {t.p} | {t.m} | {t.schedule} | {best.schedule} | {why} |")
    return "\n".join(lines)


def shapes(ps: Sequence[int], factors: Sequence[int] = (1, 2, 3, 4)) -> list[tuple[int, int]]:
    return [(p, f * p) for p in ps for f in factors]


def ratio_table(rows: Sequence[PeerRow]) -> str:
    """Per cost model and torch schedule: torch's makespan / our best counterpart's, min..max over m, per p."""
    groups: dict[tuple[str, str, int], list[float]] = {}
    for key, t, best in _pairs(rows):
        assert t.makespan is not None and best.makespan is not None
        groups.setdefault(key, []).append(t.makespan / best.makespan)
    ps = sorted({r.p for r in rows})
    lines = [
        "| costs | torch schedule | " + " | ".join(f"p={p}" for p in ps) + " |",
        "| --- | --- | " + " | ".join("---" for _ in ps) + " |",
    ]
    for model in dict.fromkeys(r.costs for r in rows):
        for name in dict.fromkeys(r.torch_name for r in rows):
            cells = []
            for p in ps:
                values = groups.get((model, name, p))
                cells.append("n/a" if not values else f"{min(values):.3f}..{max(values):.3f}")
            lines.append(f"| {model} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _pairs(rows: Sequence[PeerRow]) -> list[tuple[tuple[str, str, int], PeerRow, PeerRow]]:
    groups: dict[tuple[int, int, str, str], list[PeerRow]] = {}
    for row in rows:
        groups.setdefault((row.p, row.m, row.costs, row.torch_name), []).append(row)
    out = []
    for (p, _, model, name), group in groups.items():
        theirs = [r for r in group if r.side == "torch" and r.ok]
        mine = [r for r in group if r.side == "ours" and r.ok]
        if theirs and mine:
            out.append(((model, name, p), theirs[0], min(mine, key=lambda r: (r.makespan, r.peak_m_a))))
    return out


def report(ps: Sequence[int], factors: Sequence[int], command: str) -> tuple[str, list[PeerRow]]:
    rows = [r for model in COST_MODELS for p, m in shapes(ps, factors) for r in rows_for(p, m, model)]
    models = "; ".join(
        f"{k}: T_F={v[0]:g}, T_B={v[1]:g}, T_W={v[2]:g}, T_comm={v[3]:g}" for k, v in COST_MODELS.items()
    )
    text = "\n\n".join(
        [
            "## Peers: torch.distributed.pipelining's schedules vs ours (simulator)",
            f"Command: `{command}` (regenerates this section).",
            "torch 2.13's orders are imported from each schedule's own `pipeline_order` "
            "(`megatron_pp_ext/analysis/torch_orders.py`: torch `I` = our `B`, torch `B` = our `BW`, DualPipeV's "
            "`OVERLAP_F_B` = its forward then its backward, no overlap credit), validated by our validator and "
            "simulated by our simulator next to our counterparts with the same costs. Costs per 1F1B stage "
            f"({models}); a stage of a 2-chunk schedule (interleaved, looped BFS, V) costs half, a hop the same. "
            "Peak memory: worst rank, units of M_a (one 1F1B stage's activation), live from F to the last backward "
            "op. torch's single-stage `Schedule1F1B` order numbers the last rank's forwards 1..m: handled (renumbered "
            "0..m-1; see the note column). torch's DualPipeV is compared with our `dualpipev` and `v-zb`. "
            "Our counterparts of InterleavedZeroBubble (a 2-chunk looped zero-bubble order at 1F1B's memory): "
            "`interleaved-zb` (2 chunks, memory p M_a by default, like torch's), `bfs-zb` (2 chunks, memory m), "
            "`zb-h1` and `zb-auto` (1 chunk).",
            "### Where torch's order is better (every case; shorter makespan than all our counterparts, or equal "
            "makespan and lower peak memory)",
            better_table(torch_better(rows)),
            "### torch makespan / our best counterpart's (min..max over m; < 1 means torch is faster)",
            ratio_table(rows),
            "### Every case",
            markdown_table(rows),
        ]
    )
    return text, rows


def plot_rows(rows: Sequence[PeerRow], directory: str, memory_shape: tuple[int, int] | None = None) -> list[Path]:
    """Bubble rate vs m (one panel per cost model and p) and peak memory per rank; PNG files in ``directory``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(directory)
    out_dir.mkdir(parents=True, exist_ok=True)
    models = list(dict.fromkeys(r.costs for r in rows))
    ps = sorted({r.p for r in rows})
    names = list(dict.fromkeys(r.schedule for r in rows))
    colors = {n: plt.get_cmap("tab20")(i % 20) for i, n in enumerate(names)}
    fig, axes = plt.subplots(len(models), len(ps), figsize=(4.2 * len(ps), 3.6 * len(models)), squeeze=False)
    for i, model in enumerate(models):
        for j, p in enumerate(ps):
            ax = axes[i][j]
            for name in names:
                pts = sorted(
                    (r.m, r.bubble_rate) for r in rows if r.schedule == name and r.p == p and r.costs == model and r.ok
                )
                if pts:
                    style = "--" if name.startswith("torch:") else "-"
                    ax.plot(
                        [x for x, _ in pts],
                        [y for _, y in pts],
                        style,
                        marker="o",
                        ms=3,
                        color=colors[name],
                        label=name,
                    )
            ax.set_title(f"{model} costs, p={p}", fontsize=9)
            ax.set_xlabel("m")
            ax.set_ylabel("bubble rate (per-rank span)")
            ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=6, fontsize=7)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    bubble = out_dir / "peers_bubble_vs_m.png"
    fig.savefig(bubble, dpi=90)
    plt.close(fig)

    p, m = memory_shape or (ps[min(1, len(ps) - 1)], 4 * ps[min(1, len(ps) - 1)])
    chosen = [r for r in rows if r.p == p and r.m == m and r.costs == models[0] and r.ok and r.peak_per_rank]
    if not chosen:
        return [bubble]
    seen: set[str] = set()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for r in chosen:
        if r.schedule in seen:
            continue
        seen.add(r.schedule)
        style = "--" if r.side == "torch" else "-"
        ax.plot(range(p), r.peak_per_rank, style, marker="o", ms=3, color=colors[r.schedule], label=r.schedule)
    ax.set_title(f"peak live activations per rank, p={p}, m={m}, {models[0]} costs")
    ax.set_xlabel("rank")
    ax.set_ylabel("peak activations (M_a)")
    ax.set_yscale("log", base=2)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    memory = out_dir / "peers_peak_memory_per_rank.png"
    fig.savefig(memory, dpi=90)
    plt.close(fig)
    return [bubble, memory]
