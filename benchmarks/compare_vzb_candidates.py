"""Every v-zb candidate (each policy of ``zbv.POLICIES``, not only the winner the golden test pins),
to compare its op lists and engine timing before and after a change.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/compare_vzb_candidates.py --write /tmp/before.json
    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/compare_vzb_candidates.py --check /tmp/before.json

Grid: p in 2, 3, 4, 6; m in 1, 2, 3, p, 2p-1, 2p, 3p+1; four cost sets; limits None, 1, p/2, p, 1.5p, inf.
Floats are kept exactly (``repr``); ``--check`` exits 1 on any difference.
"""

from __future__ import annotations

import math
from typing import Any

from snapshot_check import write_or_check

from megatron_pp_ext.schedules.costs import Costs, stage_costs
from megatron_pp_ext.schedules.generators import zbv

COSTS = {
    "unit": None,
    "fbw-comm": Costs(1.0, 1.5, 0.7, None, 0.1),
    "b-heavy": Costs(1.0, 2.0, 1.0, None, 0.05),
    "w-light": Costs(1.0, 1.2, 0.3, None, 0.0),
}


def collect() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in (2, 3, 4, 6):
        for m in (1, 2, 3, p, 2 * p - 1, 2 * p, 3 * p + 1):
            for label, costs in COSTS.items():
                sc = stage_costs(costs, 2 * p)
                for limit in (None, 1, p / 2, p, 1.5 * p, math.inf):
                    units = zbv._v_memory_limit(limit, p)
                    for i, policy in enumerate(zbv.POLICIES):
                        made = zbv._candidate(p, m, sc, units, policy)
                        key = f"p{p}/m{m}/{label}/mem{limit}/policy{i}"
                        if made is not None:
                            rows, t = made
                            timing = [repr(t.makespan), repr(t.spans), repr(t.busy), repr(t.peaks)]
                            out[key] = [[str(op) for op in row] for row in rows] + [timing]
                        else:
                            out[key] = None
    return out


def main() -> None:
    write_or_check(__doc__ or "", collect, "candidates", lambda now: f" ({sum(v is None for v in now.values())} stall)")


if __name__ == "__main__":
    main()
