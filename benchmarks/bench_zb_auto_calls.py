"""zb-auto generation time per call, small to large (the shared engine must not make generation slower).

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/bench_zb_auto_calls.py [--label NAME]

Per case: the best of 5 timings of a batch of calls (10 calls at p >= 8, 200 at p = 4), CPU milliseconds
per call. Only ``generate`` and ``Costs`` are used, so the same file times an older tree too:
``(cd OLD_TREE && PYTHONPATH=. python /path/to/bench_zb_auto_calls.py --label old)``.
"""

from __future__ import annotations

import argparse
import gc
import time

from megatron_pp_ext.schedules import generate
from megatron_pp_ext.schedules.costs import Costs

UNEQUAL = Costs(1.0, 1.5, 0.7, None, 0.1)
CASES: list[tuple[str, int, int, dict[str, object]]] = [
    ("p=8, m=64", 8, 64, {}),
    ("p=8, m=64, unequal", 8, 64, {"costs": UNEQUAL}),
    ("p=16, m=128, unequal, limit 24", 16, 128, {"costs": UNEQUAL, "memory_limit": 24}),
    ("p=4, m=16", 4, 16, {}),
    ("p=4, m=12, unequal", 4, 12, {"costs": UNEQUAL}),
]


def per_call_ms(p: int, m: int, kwargs: dict[str, object]) -> float:
    calls = 200 if p <= 4 else 10
    best = float("inf")
    for _ in range(5):
        gc.collect()
        t = time.process_time()
        for _ in range(calls):
            generate("zb-auto", p, m, **kwargs)  # type: ignore[arg-type]
        best = min(best, (time.process_time() - t) / calls)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", default="this tree")
    args = parser.parse_args()
    print(args.label + ": " + " | ".join(f"{name} {per_call_ms(p, m, kw):.2f} ms" for name, p, m, kw in CASES))


if __name__ == "__main__":
    main()
