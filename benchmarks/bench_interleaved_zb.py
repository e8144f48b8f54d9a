"""interleaved-zb next to torch's ScheduleInterleavedZeroBubble (ZB1P), interleaved-1f1b and zb-h1.

Every schedule runs the same model on ``p`` ranks: ``zb-h1`` on ``p`` stages with the costs of one 1F1B
stage, the 2-chunk schedules on ``2p`` stages costing half each (a hop costs ``T_comm`` either way).
torch 2.13's order is imported from its own ``pipeline_order`` (``analysis/torch_orders.py``) and, like
ours, validated, lowered and timed by ``analysis.simulate`` (async communication, the default).
Rows: ``interleaved-zb`` at its default memory limit ``p`` M_a (what ZB1P holds) and at ``1.5p`` M_a
(about interleaved-1f1b's peak), torch's order, ``interleaved-1f1b`` (v=2, groups of p), ``zb-h1``.

Cost models (per 1F1B stage, T_F / T_B / T_W / T_comm): ``unit`` 1/1/1/0; ``profiled`` 1/1.1/0.6/0.05
(bench_zero_bubble.py's ratios); ``zb-1.5b`` 18.522/18.086/9.337/0.601 ms, the zero-bubble paper's
profiled 1.5B model at p=8 (its Table 9; also bench_dualpipev.py).

    PYTHONPATH=. python benchmarks/bench_interleaved_zb.py --write benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse

from megatron_pp_ext.analysis import simulate
from megatron_pp_ext.analysis.torch_orders import import_torch_schedule
from megatron_pp_ext.bench.results_file import write_block
from megatron_pp_ext.schedules import Schedule, generate
from megatron_pp_ext.schedules.costs import Costs

COST_MODELS: dict[str, tuple[float, float, float, float]] = {
    "unit": (1.0, 1.0, 1.0, 0.0),
    "profiled": (1.0, 1.1, 0.6, 0.05),
    "zb-1.5b": (18.522, 18.086, 9.337, 0.601),
}
BLOCK = "interleaved-zb"
COLUMNS = ("interleaved-zb", "interleaved-zb 1.5p", "torch ZB1P", "interleaved-1f1b", "zb-h1")


def stage_costs(model: str, chunks: int) -> Costs:
    f, b, w, comm = COST_MODELS[model]
    return Costs(f / chunks, b / chunks, w / chunks, None, comm)


def schedules(p: int, m: int, model: str) -> dict[str, tuple[Schedule, Costs]]:
    """The compared schedules at one shape, each with the stage costs it runs with."""
    half, full = stage_costs(model, 2), stage_costs(model, 1)
    return {
        "interleaved-zb": (generate("interleaved-zb", p, m, v=2, costs=half), half),
        "interleaved-zb 1.5p": (generate("interleaved-zb", p, m, v=2, costs=half, memory_limit=1.5 * p), half),
        "torch ZB1P": (import_torch_schedule("InterleavedZeroBubble", p, m).schedule, half),
        "interleaved-1f1b": (generate("interleaved-1f1b", p, m, v=2), half),
        "zb-h1": (generate("zb-h1", p, m), full),
    }


def measure(p: int, m: int, model: str) -> dict[str, tuple[float, float, float]]:
    """``{column: (makespan, bubble rate, worst peak in M_a)}``."""
    out = {}
    for name, (schedule, costs) in schedules(p, m, model).items():
        r = simulate(schedule, costs)
        out[name] = (r.makespan, r.bubble_rate, max(r.peak_activations_1f1b_units))
    return out


def table(ps: list[int]) -> tuple[str, int, int, int]:
    """Markdown table; cases, cases where interleaved-zb (p M_a) is not slower than torch, and strictly faster."""
    head = "| costs | p | m | " + " | ".join(f"{c}: makespan (bubble, peak M_a)" for c in COLUMNS) + " |"
    lines = [head, "|" + " --- |" * (3 + len(COLUMNS))]
    cases = not_worse = better = 0
    for model in COST_MODELS:
        for p in ps:
            for m in (p, 2 * p, 3 * p, 4 * p):
                got = measure(p, m, model)
                ours, torch = got["interleaved-zb"][0], got["torch ZB1P"][0]
                cases += 1
                not_worse += ours <= torch * (1 + 1e-9)
                better += ours < torch * (1 - 1e-9)
                cells = [f"{t:.4g} ({b:.3f}, {pk:g})" for t, b, pk in (got[c] for c in COLUMNS)]
                lines.append(f"| {model} | {p} | {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines), cases, not_worse, better


def _about() -> list[str]:
    """The module doc's paragraphs on the setting, as single lines."""
    return [part.replace("\n", " ") for part in (__doc__ or "").split("\n\n")[1:3]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-p", default="2,4,8,16", help="comma-separated pipeline sizes")
    parser.add_argument("--write", metavar="RESULTS_MD", help="replace this script's section of RESULTS_MD")
    args = parser.parse_args()
    ps = [int(x) for x in args.p.split(",")]
    text, cases, not_worse, better = table(ps)
    summary = (
        f"interleaved-zb (p M_a) vs torch's ZB1P order: not slower in {not_worse} of {cases} cases, faster in {better}."
    )
    print(text, summary, sep="\n\n")
    if args.write:
        command = "PYTHONPATH=. python benchmarks/bench_interleaved_zb.py --write benchmarks/RESULTS.md"
        section = "\n\n".join(
            [
                "## Interleaved zero bubble vs torch's ZB1P (simulator)",
                f"Command: `{command}` (regenerates this section). "
                + " ".join(__doc__.split("\n\n")[1:3]).replace("\n", " "),
                summary,
                text,
            ]
        )
        write_block(args.write, BLOCK, section)


if __name__ == "__main__":
    main()
