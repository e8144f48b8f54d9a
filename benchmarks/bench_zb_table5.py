"""The zero-bubble paper's Table 5 (bubble rates from profiled times) in our simulator, with zb-auto's
span objective and the paper's W memory accounting, and back-to-back iterations with and without
optimizer post-validation.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/bench_zb_table5.py [--authors-zb PATH]

Costs: the paper's profiled 1.5B model at p=8, m=24 (Table 9: T_F 18.522, T_B 18.086, T_W 9.337,
T_comm 0.601 ms; the only row of Table 9 this repository has, also used at m=32 and 64). W memory:
``M_W / M_B`` of the 1.5B model with stored attention scores (``planner.memory.w_memory_fraction``,
0.3664). ZB-1p / ZB-2p = ``zb-auto --memory-limit p|2p --objective span --w-memory 0.3664``.

* ``bubble``: the paper's (longest per-rank span); ``sync bubble``: over the global makespan;
* ``iter (sync)`` / ``iter (post-val.)``: ms per iteration over 4 back-to-back iterations (steady
  state), with the step synchronisation / with optimizer post-validation (step time 0);
* ``peak``: worst rank's live activations with a pending W counted at 0.3664.

``--authors-zb PATH``: the authors' ``zb.py`` (``megatron/core/pipeline_parallel/zerobubble/scheduler/``
of github.com/sail-sg/zero-bubble-pipeline-parallelism); when given, their heuristic runs on the same
costs and accounting (their own timing) for the comparison columns. Without it the comparison uses
our re-expression of that heuristic (``schedules/generators/zb_rounds.py``).
"""

from __future__ import annotations

import argparse
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_pp_ext.analysis import simulate
from megatron_pp_ext.planner.memory import TrainingSetup, w_memory_fraction
from megatron_pp_ext.planner.models import get_model
from megatron_pp_ext.schedules import Schedule, generate
from megatron_pp_ext.schedules.costs import Costs, stage_costs
from megatron_pp_ext.schedules.generators.zb_rounds import ROUND_VARIANTS, rounds_order

PAPER_1_5B = Costs(18.522, 18.086, 9.337, None, 0.601)
UNEQUAL = Costs(1.0, 1.5, 0.7, None, 0.1)
W = w_memory_fraction(get_model("zb-1.5b"), 1, TrainingSetup(attention="unfused"), "none")
# the paper's Table 5 figures this repository records; None = not recorded
PAPER = {
    (24, "1f1b"): 0.2431,
    (24, "zb-h2"): 0.1083,
    (24, "ZB-2p"): 0.0433,
    (32, "ZB-2p"): 0.0039,
}


def row(p: int, m: int, label: str, schedule: Schedule, costs: Costs) -> list[str]:
    res = simulate(schedule, costs, w_retained_fraction=W)
    sync = simulate(schedule, costs, iterations=4)
    pv = simulate(schedule, costs, iterations=4, post_validation=True)
    assert sync.iterations is not None and pv.iterations is not None
    paper = PAPER.get((m, label))
    return [
        str(p),
        str(m),
        label,
        f"{res.bubble_rate:.4f}",
        "-" if paper is None else f"{paper:.4f}",
        f"{res.sync_bubble_rate:.4f}",
        f"{sync.iterations.time:.1f}",
        f"{pv.iterations.time:.1f}",
        f"{max(res.peak_activations):.2f}",
        str(schedule.params.get("candidate", "")),
    ]


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def table5() -> str:
    rows = []
    for m in (24, 32, 64):
        p = 8
        for name in ("1f1b", "zb-h1", "zb-h2"):
            rows.append(row(p, m, name, generate(name, p, m), PAPER_1_5B))
        for label, limit in (("ZB-1p", p), ("ZB-2p", 2 * p)):
            s = generate("zb-auto", p, m, costs=PAPER_1_5B, memory_limit=limit, objective="span", w_memory=W)
            rows.append(row(p, m, label, s, PAPER_1_5B))
    header = [
        "p",
        "m",
        "schedule",
        "bubble",
        "paper",
        "sync bubble",
        "iter (sync)",
        "iter (post-val.)",
        "peak",
        "picked",
    ]
    return table(header, rows)


# ---- the authors' heuristic -------------------------------------------------------------------------------
@dataclass
class _Config:  # the fields their Graph reads
    cost_f: list[float]
    cost_b: list[float]
    cost_w: list[float]
    cost_comm: float
    mem_f: list[float]
    mem_b: list[float]
    mem_w: list[float]
    max_mem: list[float]
    print_scaling: int = 1
    n_stages: int = 0
    n_micro: int = 0


def load_authors(path: str) -> Any:
    """Their module with its imports (torch, pulp, their graph types) stubbed: only the heuristic runs."""
    for name in ("torch", "pulp", "megatron", "megatron.core", "megatron.core.pipeline_parallel"):
        sys.modules.setdefault(name, types.ModuleType(name))
    if not hasattr(sys.modules["torch"], "Tensor"):  # a stub: their annotations name torch.Tensor
        sys.modules["torch"].Tensor = object  # type: ignore[attr-defined]
    graph = types.ModuleType("megatron.core.pipeline_parallel.zerobubble.scheduler.graph")
    graph.GraphConfig = _Config  # type: ignore[attr-defined]
    graph.ScheduledNode = object  # type: ignore[attr-defined]
    graph.FuncType = object  # type: ignore[attr-defined]
    sys.modules["megatron.core.pipeline_parallel.zerobubble.scheduler.graph"] = graph
    module = sys.modules["authors_zb"] = types.ModuleType("authors_zb")  # dataclasses look their module up
    exec(compile(Path(path).read_text(), path, "exec"), module.__dict__)
    return module


def authors_span(module: Any, p: int, m: int, costs: Costs, limit: float, w: float) -> float | None:
    sc = stage_costs(costs, p)
    cfg = _Config(list(sc.f), list(sc.b), list(sc.w), sc.comm, [1.0] * p, [-(1 - w)] * p, [-w] * p, [limit] * p)
    graph = module.Graph.build_graph(p, m, cfg)
    best = None
    for flags in ((a, b, c) for a in (True, False) for b in (True, False) for c in (True, False)):
        try:
            _, _, span = graph.manual_order(*flags)
        except ValueError:  # "Cannot fit memory"
            continue
        best = span if best is None else min(best, span)
    return best


def rounds_span(p: int, m: int, costs: Costs, limit: float, w: float) -> float:
    sc = stage_costs(costs, p)
    spans = []
    for variant in ROUND_VARIANTS:
        try:
            spans.append(max(rounds_order(p, m, sc, limit, variant, w)[1].spans))
        except ValueError:
            continue
    return min(spans)


def comparison(authors: Any | None) -> str:
    rows = []
    for cname, costs in (("1.5B", PAPER_1_5B), ("unequal", UNEQUAL)):
        for p in (4, 8, 16):
            for m in (2 * p, 3 * p, 4 * p):
                for limit_name, limit, w in (("p", p, W), ("2p", 2 * p, W), ("2p", 2 * p, 1.0)):
                    s = generate("zb-auto", p, m, costs=costs, memory_limit=limit, objective="span", w_memory=w)
                    res = simulate(s, costs, w_retained_fraction=w)
                    pv = simulate(s, costs, iterations=4, post_validation=True).iterations
                    h2 = simulate(generate("zb-h2", p, m), costs, iterations=4, post_validation=True).iterations
                    assert pv is not None and h2 is not None
                    ours = max(res.span)
                    ref = (
                        authors_span(authors, p, m, costs, limit, w) if authors else rounds_span(p, m, costs, limit, w)
                    )
                    rows.append(
                        [
                            cname,
                            str(p),
                            str(m),
                            limit_name,
                            f"{w:.4g}",
                            f"{ours:.2f}",
                            "-" if ref is None else f"{ref:.2f}",
                            "-" if ref is None else f"{(ours - ref) / ref:+.2%}",
                            f"{pv.time:.2f}",
                            f"{h2.time:.2f}",
                            f"{max(res.peak_activations):.2f}",
                        ]
                    )
    who = "the authors' code" if authors else "our re-expression of the authors' heuristic (zb_rounds)"
    header = [
        "costs", "p", "m", "limit", "W keeps", "zb-auto span", f"{who}: span", "ours vs theirs",
        "zb-auto iter (post-val.)", "zb-h2 iter (post-val.)", "zb-auto peak",
    ]  # fmt: skip
    return table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--authors-zb", metavar="PATH", help="the authors' zb.py, to run their heuristic")
    args = parser.parse_args()
    authors = load_authors(args.authors_zb) if args.authors_zb else None
    print(f"W memory fraction (zb-1.5b, stored attention scores): {W:.4f}\n")
    print(table5())
    print()
    print(comparison(authors))


if __name__ == "__main__":
    main()
