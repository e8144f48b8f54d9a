"""DualPipeV next to V-ZB in the simulator, with the overlap factor of its forward-and-backward pairs.

Costs: the zero-bubble paper's profiled 1.5B model at p=8, m=24 (T_F = 18.522, T_B = 18.086,
T_W = 9.337, T_comm = 0.601 ms; with them the simulator gives 1F1B 0.2431 and ZB-H2 0.1083, the
published figures). A V placement cuts the model into 2p stages, so a V stage costs half
(T_comm per hop unchanged); 1F1B and ZB-H2 on p stages of full cost give the scale.

Rows: ``v-zb`` (memory limit p and 2p), our ``dualpipev`` and torch's ``ScheduleDualPipeV``
compute order imported into the IR (torch 2.13.0, ``torch/distributed/pipelining/schedules.py``),
timed with the overlap factor F = 0 (pairs one after the other), 0.5 and 1 (a pair takes
max + (1-F) x min).

* ``makespan``: global, ms; ``bubble``: the zero-bubble paper's span bubble ``(C - busy) / C``
  where busy counts a pair as ``max + (1-F) min``; ``vs serial work``:
  ``(makespan - m (T_F+T_B+T_W)) / makespan``, which overlap can make negative;
* ``peak``: worst rank's live activations from F to W, in 1F1B units M_a (two V-stage activations).

    PYTHONPATH=. python benchmarks/bench_dualpipev.py [-p 8] [-m 24]
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

from megatron_pp_ext.analysis import simulate
from megatron_pp_ext.analysis.torch_orders import import_order
from megatron_pp_ext.schedules import Schedule, generate
from megatron_pp_ext.schedules.costs import Costs

COSTS_1_5B = Costs(18.522, 18.086, 9.337, None, 0.601)
COSTS_1_5B_V = Costs(18.522 / 2, 18.086 / 2, 9.337 / 2, None, 0.601)  # per V stage (half the layers)
FACTORS = (0.0, 0.5, 1.0)


def torch_dualpipev(p: int, m: int) -> Schedule:
    import torch
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV

    fake = SimpleNamespace(pp_group_size=p, _n_microbatches=m)  # all its order computation reads
    order = [ScheduleDualPipeV._calculate_single_rank_operations(fake, r) for r in range(p)]
    return import_order(order, m, name=f"torch {torch.__version__} DualPipeV", overlap_pairs=True).schedule


def rows(p: int, m: int, costs: Costs, v_costs: Costs) -> list[list[str]]:
    cases = [
        ("1f1b", generate("1f1b", p, m), (0.0,), costs),
        ("zb-h2", generate("zb-h2", p, m), (0.0,), costs),
        ("v-zb (limit p)", generate("v-zb", p, m, costs=v_costs, memory_limit=p), (0.0,), v_costs),
        ("v-zb (limit 2p)", generate("v-zb", p, m, costs=v_costs, memory_limit=2 * p), (0.0,), v_costs),
        ("dualpipev (ours)", generate("dualpipev", p, m), FACTORS, v_costs),
        ("DualPipeV (torch order)", torch_dualpipev(p, m), FACTORS, v_costs),
    ]
    work = m * (costs.t_f + costs.t_b + costs.t_w)  # type: ignore[operator]
    out = []
    for label, schedule, factors, stage_costs in cases:
        for f in factors:
            r = simulate(schedule, stage_costs, overlap=f)
            out.append(
                [
                    label,
                    f"{f:g}" if schedule.overlap_pairs else "-",
                    f"{r.makespan:.1f}",
                    f"{r.bubble_rate:.4f}",
                    f"{(r.makespan - work) / r.makespan:.4f}",
                    f"{max(r.peak_activations_1f1b_units):g}",
                ]
            )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-p", type=int, default=8)
    parser.add_argument("-m", type=int, default=24)
    args = parser.parse_args()
    header = ["schedule", "overlap F", "makespan (ms)", "bubble", "vs serial work", "peak (M_a)"]
    print(f"p={args.p} m={args.m}, costs per 1F1B stage {COSTS_1_5B}, per V stage {COSTS_1_5B_V}")
    print("| " + " | ".join(header) + " |")
    print("|" + "|".join("---" for _ in header) + "|")
    for row in rows(args.p, args.m, COSTS_1_5B, COSTS_1_5B_V):
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
