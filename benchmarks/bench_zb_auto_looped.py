"""zb-auto with v = 2 chunks per rank: W memory fraction and span objective.

For each shape, zb-auto -v 2 is generated four ways: objective ``makespan`` / ``span`` with whole
activations until W (``w_memory`` 1) and with the given fraction. Every figure comes from
``analysis.simulate`` (independent of the generator's engine): the post-validated time per iteration
(3 back-to-back iterations without step synchronisation), the single-iteration makespan, and the worst
rank's peak in stage activations counted with the run's ``w_retained_fraction`` (``peak``) and with whole
activations until W (``peak@1``). The limit is in stage activations (zb-auto's unit).

Costs per stage of the 2-chunk schedule (T_F / T_B / T_W / T_comm): ``zb-1.5b/2`` the zero-bubble paper's
profiled 1.5B model (its Table 9) halved; ``profiled/2`` bench_zero_bubble.py's ratios halved; ``w-heavy``
0.5/0.5/1.0/0.05.

    PYTHONPATH=. python benchmarks/bench_zb_auto_looped.py --write benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse

from megatron_pp_ext.analysis import simulate
from megatron_pp_ext.bench.results_file import write_block
from megatron_pp_ext.schedules import generate
from megatron_pp_ext.schedules.costs import Costs

COST_MODELS: dict[str, Costs] = {
    "zb-1.5b/2": Costs(18.522 / 2, 18.086 / 2, 9.337 / 2, None, 0.601),
    "profiled/2": Costs(0.5, 0.55, 0.3, None, 0.05),
    "w-heavy": Costs(0.5, 0.5, 1.0, None, 0.05),
}
#: (cost model, p, m, limit in stage activations, w_memory)
SHAPES = [
    ("zb-1.5b/2", 4, 12, 8, 0.3664),
    ("zb-1.5b/2", 8, 24, 16, 0.3664),
    ("zb-1.5b/2", 8, 32, 16, 0.3664),
    ("profiled/2", 3, 7, 9, 0.3),
    ("profiled/2", 4, 9, 12, 0.6),
    ("w-heavy", 4, 9, 12, 0.6),
    ("w-heavy", 6, 13, 18, 0.3),
]
ITERATIONS = 3
BLOCK = "zb-auto-looped"
COMMAND = "PYTHONPATH=. python benchmarks/bench_zb_auto_looped.py --write benchmarks/RESULTS.md"


def cell(model: str, p: int, m: int, limit: int, w: float, objective: str) -> str:
    costs = COST_MODELS[model]
    schedule = generate("zb-auto", p, m, v=2, costs=costs, memory_limit=limit, objective=objective, w_memory=w)
    run = simulate(schedule, costs, iterations=ITERATIONS, post_validation=True, w_retained_fraction=w)
    whole = max(simulate(schedule, costs).peak_activations)
    assert run.iterations is not None
    peak = max(run.peak_activations)
    return f"{run.iterations.time:.4g} / {run.makespan:.4g} ({peak:.3g}, {whole:g})"


def table() -> list[str]:
    head = ["costs", "p", "m", "limit", "w"]
    cols = [(1.0, "makespan"), (1.0, "span"), ("w", "makespan"), ("w", "span")]
    head += [f"{obj}, w_memory {'1' if w == 1.0 else 'w'}" for w, obj in cols]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for model, p, m, limit, w in SHAPES:
        row = [model, str(p), str(m), str(limit), f"{w:g}"]
        row += [cell(model, p, m, limit, w if fraction == "w" else 1.0, obj) for fraction, obj in cols]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def sweep() -> dict[str, int]:
    """Counts over a grid (every cost model; p 2, 3, 4, 6; m p, 2p+1, 3p; limits 2, p, p+1, 2p, 3p stage
    activations; w 1, 0.6, 0.3): span vs makespan objective (post-validated time), and w < 1 vs w = 1
    (makespan objective, single-iteration makespan)."""
    counts = dict.fromkeys(("shapes", "span better", "span worse", "w shapes", "w faster", "w slower"), 0)
    for costs in COST_MODELS.values():
        for p in (2, 3, 4, 6):
            for m in (p, 2 * p + 1, 3 * p):
                for limit in sorted({2, p, p + 1, 2 * p, 3 * p}):
                    whole = None
                    for w in (1.0, 0.6, 0.3):
                        kw = {"v": 2, "costs": costs, "memory_limit": limit, "w_memory": w}
                        made = generate("zb-auto", p, m, objective="makespan", **kw)
                        span = generate("zb-auto", p, m, objective="span", **kw)
                        times = [
                            simulate(x, costs, iterations=ITERATIONS, post_validation=True).iterations.time  # type: ignore[union-attr]
                            for x in (made, span)
                        ]
                        counts["shapes"] += 1
                        counts["span better"] += times[1] < times[0] - 1e-9
                        counts["span worse"] += times[1] > times[0] + 1e-9
                        makespan = simulate(made, costs).makespan
                        if whole is None:
                            whole = makespan
                            continue
                        counts["w shapes"] += 1
                        counts["w faster"] += makespan < whole - 1e-9
                        counts["w slower"] += makespan > whole + 1e-9
    return counts


def section() -> str:
    c = sweep()
    grid = " ".join((sweep.__doc__ or "").split("(", 1)[1].split(")", 1)[0].split())
    return "\n".join(
        [
            "### zb-auto with v = 2: W memory fraction and span objective (simulator)",
            "",
            f"Command: `{COMMAND}` (regenerates this section). zb-auto -v 2 under each objective, with whole "
            "activations until W (w_memory 1) and with the shape's fraction w; the limit is in stage activations. "
            f"Cells: post-validated time per iteration ({ITERATIONS} back-to-back iterations, no step "
            "synchronisation) / single-iteration makespan (worst peak counted with the cell's w_memory, the same "
            "order's peak counted with whole activations until W), all from `analysis.simulate`. Costs per "
            "stage (T_F/T_B/T_W/T_comm): zb-1.5b/2 = the zero-bubble paper's 1.5B Table 9 times halved, with "
            "its M_W/M_B = 0.3664; profiled/2 = 0.5/0.55/0.3/0.05; w-heavy = 0.5/0.5/1.0/0.05.",
            "",
            *table(),
            "",
            "Every peak is within its limit (tests/schedules/test_interleaved_zb.py checks it on a grid). "
            f"Sweep ({grid}): the span objective's post-validated "
            f"time is below the makespan objective's in {c['span better']} of {c['shapes']} shapes and above it "
            f"in {c['span worse']}; a W fraction below 1 gives a shorter makespan than whole activations in "
            f"{c['w faster']} of {c['w shapes']} shapes and a longer one in {c['w slower']}. The looped policies "
            "rarely differ in span (no span-specific candidates like the v = 1 path's round heuristic, zb_rounds), "
            "and the room a smaller W share leaves helps only where the limit binds the steady state.",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", metavar="RESULTS_MD", help="replace (or add) this script's section of RESULTS_MD")
    args = parser.parse_args()
    text = section()
    if not args.write:
        print(text)
        return
    write_block(args.write, BLOCK, text, after="interleaved-zb")


if __name__ == "__main__":
    main()
