"""A self-contained HTML schedule explorer (``megatron-pp draw --html``): no network, no dependencies.

One page holds several precomputed variants (schedule x p x m x cost model). For the selected one it
draws every rank's ops on a time axis (SVG) and, under it, each rank's live activation memory over
time. Hovering an op shows its kind, stage, micro-batch, chunk, start, end and the rank's live
activation memory while it runs.

Memory, per rank, in units of ``M_a`` (one 1F1B stage's activation for one micro-batch; a stage of a
v-chunk schedule holds ``1/v`` of it): an ``F`` adds its stage's activation when it starts, a ``W``
or ``BW`` frees it when it ends (a ``B`` keeps it for its ``W``): the simulator's default accounting
(``w_retained_fraction = 1``), so the curve's maximum is the simulator's peak.
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ..schedules.ir import OpKind
from ..schedules.schedule import Schedule
from .schedule_check import validate
from .simulate import SimResult, simulate

KINDS = ("F", "B", "W", "BW")


@dataclass(frozen=True)
class ExplorerVariant:
    schedule: str
    p: int
    m: int
    costs: str

    @property
    def key(self) -> str:
        return f"{self.schedule}|{self.p}|{self.m}|{self.costs}"


def _r(x: float) -> float:
    return round(x, 6)


def variant_data(schedule: Schedule, result: SimResult) -> dict[str, object]:
    """Plain JSON data of one simulated schedule: ops per rank and memory steps per rank."""
    chunks = max(1, round(schedule.placement.stages_per_rank_per_replica))
    size = 1.0 / chunks  # one stage activation in M_a
    ranks = []
    for rank, row in enumerate(schedule.ops):
        events: list[tuple[float, int, float]] = []  # (time, order, delta); frees before allocations at one time
        ops = []
        timeline = [t for t in result.timeline if t[0] == rank]
        for op, (_, _, start, end) in zip(row, timeline, strict=True):
            if op.kind == OpKind.F:
                events.append((start, 1, size))
            elif op.kind in (OpKind.W, OpKind.BW):
                events.append((end, 0, -size))
            ops.append(
                [
                    KINDS.index(op.kind.value),
                    op.stage,
                    op.microbatch,
                    schedule.placement.chunk_of(op.stage),
                    _r(start),
                    _r(end),
                ]
            )
        events.sort()
        steps: list[list[float]] = [[0.0, 0.0]]
        live = 0.0
        for time, _, delta in events:
            live = _r(live + delta)
            if steps[-1][0] == _r(time):
                steps[-1][1] = live
            else:
                steps.append([_r(time), live])
        for op_row in ops:  # live memory while the op runs: after an F's allocation, before a free
            start, end = op_row[4], op_row[5]
            is_f = op_row[0] == 0
            at = start if is_f else end
            op_row.append(_memory_at(steps, at, after=is_f))
        ranks.append({"ops": ops, "memory": steps})
    return {
        "name": schedule.name,
        "p": schedule.num_ranks,
        "m": schedule.num_microbatches,
        "chunks": chunks,
        "makespan": _r(result.makespan),
        "bubble": _r(result.bubble_rate),
        "peak": _r(max(result.peak_activations_1f1b_units, default=0.0)),
        "ranks": ranks,
    }


def _memory_at(steps: Sequence[Sequence[float]], time: float, after: bool) -> float:
    value = 0.0
    for t, v in steps:
        if t < time or (after and t == time):
            value = v
        else:
            break
    return value


def build_variants(
    schedules: Iterable[str], shapes: Iterable[tuple[int, int]], cost_models: Iterable[str]
) -> dict[str, dict[str, object]]:
    """Generate, validate and simulate every variant; a variant a generator refuses gets ``{"error": ...}``.

    ``torch:<name>`` (a key of :data:`~megatron_pp_ext.analysis.torch_orders.TORCH_SCHEDULES`) is torch's order."""
    from ..schedules.ir import ScheduleError
    from .peers import ours, stage_costs

    shapes, cost_models = list(shapes), list(cost_models)
    out: dict[str, dict[str, object]] = {}
    for name in schedules:
        for p, m in shapes:
            for model in cost_models:
                key = ExplorerVariant(name, p, m, model).key
                try:
                    if name.startswith("torch:"):  # torch.distributed.pipelining's order (imports torch)
                        from .torch_orders import import_torch_schedule

                        schedule = import_torch_schedule(name.partition(":")[2], p, m).schedule
                    else:
                        schedule = ours(name, p, m, model)
                    costs = stage_costs(model, max(1, round(schedule.placement.stages_per_rank_per_replica)))
                    out[key] = variant_data(schedule, simulate(schedule, costs, lowered=validate(schedule)))
                except (ScheduleError, ValueError) as exc:
                    out[key] = {"error": str(exc).splitlines()[0][:200]}
    return out


def render(variants: dict[str, dict[str, object]], title: str = "megatron_pp_ext schedule explorer") -> str:
    """The HTML page (inline CSS, JS and JSON data)."""
    data = json.dumps(variants, separators=(",", ":")).replace("</", "<\\/")
    return _PAGE.replace("__TITLE__", html.escape(title)).replace("__DATA__", data)


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>__TITLE__</title>
<style>
body{font-family:sans-serif;margin:12px;color:#222}
#controls label{margin-right:14px} #summary{margin:8px 0;font-size:14px}
#tooltip{position:fixed;display:none;background:#fff;border:1px solid #888;padding:6px 8px;font-size:12px;
 pointer-events:none;box-shadow:2px 2px 6px rgba(0,0,0,.2)}
#tooltip td{padding:0 6px 0 0} .lane{font-size:11px} #error{color:#b00}
svg text{font-size:10px}
</style></head><body>
<h2>__TITLE__</h2>
<div id="controls">
<label>schedule <select id="sel-schedule"></select></label><label>p <select id="sel-p"></select></label>
<label>m <select id="sel-m"></select></label><label>costs <select id="sel-costs"></select></label>
</div>
<div id="summary"></div><div id="error"></div>
<svg id="gantt" xmlns="http://www.w3.org/2000/svg"></svg>
<h3>Live activation memory per rank (units of M_a)</h3>
<svg id="memory" xmlns="http://www.w3.org/2000/svg"></svg>
<div id="tooltip"><table>
<tr><td>op</td><td id="tt-op"></td></tr><tr><td>rank</td><td id="tt-rank"></td></tr>
<tr><td>stage</td><td id="tt-stage"></td></tr><tr><td>micro-batch</td><td id="tt-mb"></td></tr>
<tr><td>chunk</td><td id="tt-chunk"></td></tr><tr><td>start</td><td id="tt-start"></td></tr>
<tr><td>end</td><td id="tt-end"></td></tr><tr><td>live memory (M_a)</td><td id="tt-mem"></td></tr>
</table></div>
<script type="application/json" id="data">__DATA__</script>
<script>
"use strict";
const DATA = JSON.parse(document.getElementById("data").textContent);
const KINDS = ["F", "B", "W", "BW"];
const COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd"];
const NS = "http://www.w3.org/2000/svg";
const keys = Object.keys(DATA).map(k => k.split("|"));
const sels = ["schedule", "p", "m", "costs"].map(n => document.getElementById("sel-" + n));
function uniq(i) { return [...new Set(keys.map(k => k[i]))]; }
sels.forEach((sel, i) => {
  let vals = uniq(i); if (i === 1 || i === 2) vals.sort((a, b) => a - b);
  for (const v of vals) { const o = document.createElement("option"); o.value = o.textContent = v; sel.appendChild(o); }
  sel.addEventListener("change", draw);
});
function el(name, attrs, parent) {
  const e = document.createElementNS(NS, name);
  for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
  if (parent) parent.appendChild(e);
  return e;
}
function shade(kind, chunk, chunks) {
  const h = COLORS[kind]; const a = chunks > 1 ? 0.6 * chunk / (chunks - 1) : 0;
  const c = [1, 3, 5].map(i => Math.round(parseInt(h.substr(i, 2), 16) * (1 - a) + 255 * a));
  return "rgb(" + c.join(",") + ")";
}
const tip = document.getElementById("tooltip");
function fmt(x) { return (Math.round(x * 10000) / 10000).toString(); }
function show(ev, r, op, chunks) {
  const set = (id, v) => { document.getElementById(id).textContent = v; };
  set("tt-op", KINDS[op[0]] + op[1] + "." + op[2]); set("tt-rank", r); set("tt-stage", op[1]);
  set("tt-mb", op[2]); set("tt-chunk", op[3]); set("tt-start", fmt(op[4])); set("tt-end", fmt(op[5]));
  set("tt-mem", fmt(op[6]));
  tip.style.display = "block"; tip.style.left = (ev.clientX + 12) + "px"; tip.style.top = (ev.clientY + 12) + "px";
}
function draw() {
  const key = sels.map(s => s.value).join("|");
  const v = DATA[key];
  const gantt = document.getElementById("gantt"), mem = document.getElementById("memory");
  gantt.replaceChildren(); mem.replaceChildren(); tip.style.display = "none";
  document.getElementById("error").textContent = "";
  gantt.setAttribute("data-variant", key);
  if (!v) { document.getElementById("summary").textContent = key + ": not precomputed"; return; }
  if (v.error) {
    document.getElementById("summary").textContent = key;
    document.getElementById("error").textContent = "not available: " + v.error; return;
  }
  document.getElementById("summary").textContent = v.name + ": p=" + v.p + " m=" + v.m + " chunks/rank=" + v.chunks +
    " | makespan " + fmt(v.makespan) + " | bubble " + (100 * v.bubble).toFixed(2) + "% | peak " + fmt(v.peak) + " M_a";
  const W = Math.max(900, window.innerWidth - 60), left = 60, lane = 22, scale = (W - left - 10) / v.makespan;
  gantt.setAttribute("width", W); gantt.setAttribute("height", v.p * lane + 24);
  v.ranks.forEach((rank, r) => {
    el("text", {x: 4, y: r * lane + 15, class: "lane"}, gantt).textContent = "rank " + r;
    rank.ops.forEach((op, i) => {
      const rect = el("rect", {x: left + op[4] * scale, y: r * lane + 2, width: Math.max(0.5, (op[5] - op[4]) * scale),
        height: lane - 4, fill: shade(op[0], op[3], v.chunks), stroke: "#fff", "stroke-width": 0.5,
        class: "op", "data-rank": r, "data-index": i, "data-op": KINDS[op[0]] + op[1] + "." + op[2]}, gantt);
      rect.addEventListener("mousemove", ev => show(ev, r, op, v.chunks));
      rect.addEventListener("mouseleave", () => { tip.style.display = "none"; });
    });
  });
  for (let t = 0; t <= 10; t++) {
    const x = left + t / 10 * v.makespan * scale;
    el("text", {x: x - 8, y: v.p * lane + 16}, gantt).textContent = fmt(t / 10 * v.makespan);
  }
  const mh = 44, peak = Math.max(v.peak, 1e-9);
  mem.setAttribute("width", W); mem.setAttribute("height", v.p * (mh + 6) + 8);
  v.ranks.forEach((rank, r) => {
    const y0 = r * (mh + 6) + mh;
    el("text", {x: 4, y: y0 - mh / 2, class: "lane"}, mem).textContent = "rank " + r;
    el("line", {x1: left, y1: y0, x2: left + v.makespan * scale, y2: y0, stroke: "#ccc"}, mem);
    let pts = [], prev = 0;
    for (const [t, val] of rank.memory) {
      pts.push((left + t * scale) + "," + (y0 - prev / peak * (mh - 4)));
      pts.push((left + t * scale) + "," + (y0 - val / peak * (mh - 4))); prev = val;
    }
    pts.push((left + v.makespan * scale) + "," + (y0 - prev / peak * (mh - 4)));
    el("polyline", {points: pts.join(" "), fill: "none", stroke: "#d62728", class: "mem", "data-rank": r}, mem);
    const top = Math.max(...rank.memory.map(s => s[1]));
    el("text", {x: left + v.makespan * scale - 60, y: y0 - mh + 10}, mem).textContent = "peak " + fmt(top);
  });
}
draw();
</script></body></html>
"""
