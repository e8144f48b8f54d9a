"""Generation time of the cost-aware and building-block schedules (one engine for all of them must be no slower).

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/bench_generation.py [--repeats 3]

For each case: the best of ``repeats`` runs of ``generate`` (CPU seconds of this process), plus the
whole golden grid of ``tests/schedules/golden.py`` once (every schedule, ~2k cases).
"""

from __future__ import annotations

import argparse
import gc
import time

from megatron_pp_ext.schedules import generate
from megatron_pp_ext.schedules.costs import Costs

UNEQUAL = Costs(1.0, 1.5, 0.7, None, 0.1)
CASES: list[tuple[str, int, int, dict[str, object]]] = [
    ("zb-h2", 8, 64, {}),
    ("zb-auto", 8, 64, {}),
    ("zb-auto", 8, 64, {"costs": UNEQUAL}),
    ("zb-auto", 16, 128, {"costs": UNEQUAL, "memory_limit": 24}),
    ("v-half", 8, 64, {}),
    ("v-min", 16, 128, {}),
    ("v-zb", 8, 64, {}),
    ("v-zb", 8, 64, {"costs": UNEQUAL}),
    ("v-zb", 8, 32, {"costs": UNEQUAL, "memory_limit": 4}),
    ("v-zb", 16, 64, {}),
]


def _best(name: str, p: int, m: int, kwargs: dict[str, object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        t = time.process_time()
        generate(name, p, m, **kwargs)  # type: ignore[arg-type]
        best = min(best, time.process_time() - t)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"| schedule | p | m | parameters | generate (CPU s, best of {args.repeats}) |")
    print("| --- | --- | --- | --- | --- |")
    for name, p, m, kwargs in CASES:
        label = ", ".join(f"{k}={'unequal' if v is UNEQUAL else v}" for k, v in kwargs.items()) or "-"
        print(f"| {name} | {p} | {m} | {label} | {_best(name, p, m, kwargs, args.repeats):.3f} |")
    from tests.schedules import golden  # the whole golden grid, generation + simulation

    t = time.process_time()
    n = 0
    for _, name, p, m, kwargs, costs in golden.cases():
        golden.record_case(name, p, m, kwargs, costs)
        n += 1
    print(f"| golden grid ({n} cases, generate + simulate) | | | | {time.process_time() - t:.2f} |")


if __name__ == "__main__":
    main()
