"""Golden record of every registered schedule: exact op lists, params and simulator figures.

The grid (:func:`cases`) covers each schedule over ``(p, m, v, costs, memory limit, block file)``
and a set of requests each schedule must refuse (:func:`refusals`, recording the message). The
record lives in ``data/golden.json.gz``; ``test_golden.py`` compares against it. Regenerate it
only when a change of output is intended::

    PYTHONPATH=. python -m tests.schedules.golden --write
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from megatron_pp_ext.analysis.simulate import simulate
from megatron_pp_ext.schedules import generate
from megatron_pp_ext.schedules.costs import Costs
from megatron_pp_ext.schedules.ir import ScheduleError

DATA = Path(__file__).parent / "data"
GOLDEN = DATA / "golden.json.gz"

COSTS: dict[str, Costs | None] = {
    "none": None,
    "unit": Costs(1.0, 1.0, 1.0, None, 0.0),
    "fbw-comm": Costs(1.0, 1.5, 0.7, None, 0.1),
    "b-heavy": Costs(1.0, 2.0, 1.0, None, 0.05),
    "w-light": Costs(1.0, 1.2, 0.3, None, 0.0),
}
#: The schedules the record covers (a schedule registered later joins the grid when it is added here).
RECORDED = (
    "1f1b",
    "bfs",
    "bfs-zb",
    "bitpipe",
    "bitpipe-zb",
    "dualpipev",
    "gpipe",
    "interleaved-1f1b",
    "interleaved-zb",
    "v-block",
    "v-half",
    "v-min",
    "v-zb",
    "zb-auto",
    "zeropp",
    "zb-h1",
    "zb-h2",
)
_MS = (1, 2, 3, 5, 8)  # plus p, 2p-1, 2p, 3p+1 per p


def _microbatches(p: int, extra: tuple[int, ...] = ()) -> list[int]:
    return sorted({*_MS, p, 2 * p - 1, 2 * p, 3 * p + 1, *extra} - {0})


def _per_stage(num_stages: int) -> Costs:
    f = tuple(1.0 + 0.1 * (s % 3) for s in range(num_stages))
    b = tuple(1.4 + 0.2 * (s % 2) for s in range(num_stages))
    w = tuple(0.6 + 0.05 * s for s in range(num_stages))
    return Costs(f, b, w, None, 0.05)


def cases() -> Iterator[tuple[str, str, int, int, dict[str, Any], str]]:
    """``(key, schedule, p, m, kwargs, costs name)`` for every golden case."""
    for name in ("gpipe", "1f1b"):
        for p in (1, 2, 3, 4, 6):
            for m in _microbatches(p):
                yield f"{name}/p{p}/m{m}", name, p, m, {}, "none"
    for p in (2, 3, 4):
        for v in (2, 3):
            for m in _microbatches(p, (4 * p, 2 * p + 1)):
                for group in (None, p + 1):
                    if group is not None and group > m:
                        continue
                    kwargs: dict[str, Any] = {"v": v}
                    if group is not None:
                        kwargs["microbatch_group_size"] = group
                    try:
                        generate("interleaved-1f1b", p, m, **kwargs)
                    except ScheduleError:
                        continue
                    yield f"interleaved-1f1b/p{p}/m{m}/v{v}/g{group}", "interleaved-1f1b", p, m, kwargs, "none"
    for name in ("zb-h1", "zb-h2"):
        for p in (1, 2, 3, 4, 6, 8):
            for m in _microbatches(p, (24,)):
                yield f"{name}/p{p}/m{m}", name, p, m, {}, "none"
    for p in (1, 2, 3, 4, 6):
        for m in _microbatches(p):
            for costs in ("none", "fbw-comm", "b-heavy", "w-light", "per-stage"):
                for limit in dict.fromkeys((None, 1, p, 1.5 * p, 2 * p, 3 * p, math.inf)):
                    if costs != "none" and limit in (1, 3 * p) and m not in (2 * p, 3 * p + 1):
                        continue
                    kwargs = {} if limit is None else {"memory_limit": limit}
                    yield f"zb-auto/p{p}/m{m}/{costs}/mem{limit}", "zb-auto", p, m, kwargs, costs
    for name in ("v-min", "v-half"):
        for p in (2, 3, 4, 5, 6, 8):
            for m in _microbatches(p):
                yield f"{name}/p{p}/m{m}", name, p, m, {}, "none"
    for block_file, p in (("block_p2.json", 2), ("block_p4_half.json", 4)):
        for m in _microbatches(p):
            kwargs = {"block_file": str(DATA / block_file)}
            yield f"v-block/{block_file}/m{m}", "v-block", p, m, kwargs, "none"
    for p in (2, 3, 4):
        for block in ("v-min", "v-half", None):
            for m in (1, 3, 2 * p, 3 * p + 1):
                kwargs = {} if block is None else {"block": block}
                yield f"v-block/{block}/p{p}/m{m}", "v-block", p, m, kwargs, "none"
    for p in (2, 3, 4, 6):
        for m in _microbatches(p):
            for costs in ("none", "fbw-comm", "b-heavy", "w-light", "per-stage"):
                for limit in dict.fromkeys((None, 1, p / 2, p, 1.5 * p, 2 * p, math.inf)):
                    if costs not in ("none", "fbw-comm") and limit in (1, 1.5 * p, math.inf):
                        continue
                    if p == 6 and m > 13 and costs != "none":
                        continue
                    kwargs = {} if limit is None else {"memory_limit": limit}
                    yield f"v-zb/p{p}/m{m}/{costs}/mem{limit}", "v-zb", p, m, kwargs, costs
    yield "v-zb/p8/m24/none/memNone", "v-zb", 8, 24, {}, "none"
    for name in ("bfs", "bfs-zb"):
        for p in (1, 2, 3, 4):
            for v in (1, 2, 3):
                for m in _microbatches(p):
                    for group in dict.fromkeys((None, p, 2)):
                        if group is not None and group > m:
                            continue
                        kwargs = {"v": v} if group is None else {"v": v, "microbatch_group_size": group}
                        costs = "fbw-comm" if name == "bfs-zb" and m == 2 * p else "none"
                        yield f"{name}/p{p}/m{m}/v{v}/g{group}/{costs}", name, p, m, kwargs, costs
    for p in (2, 3, 4, 6):
        for m in (2 * p, 2 * p + 1, 3 * p, 4 * p):
            yield f"dualpipev/p{p}/m{m}", "dualpipev", p, m, {}, "none"
    for p in (1, 2, 3, 4):
        for v in (1, 2, 3):
            for m in _microbatches(p):
                for unit in dict.fromkeys((None, 1, 2, p)):
                    if unit is not None and unit > m:
                        continue
                    kwargs = {"v": v} if unit is None else {"v": v, "unit_size": unit}
                    costs = "fbw-comm" if m == 2 * p else "none"
                    yield f"zeropp/p{p}/m{m}/v{v}/u{unit}/{costs}", "zeropp", p, m, kwargs, costs
        if p > 1:
            yield f"zeropp/p{p}/m{2 * p}/mem{p}", "zeropp", p, 2 * p, {"memory_limit": p}, "none"
    for name in ("bitpipe", "bitpipe-zb"):
        for p in (2, 4, 6, 8):
            for m in (p, 2 * p, 3 * p):
                yield f"{name}/p{p}/m{m}", name, p, m, {}, "none"
    yield "v-zb/p8/m16/fbw-comm/memNone", "v-zb", 8, 16, {}, "fbw-comm"
    for name in ("interleaved-zb", "zb-auto"):
        for p in (1, 2, 3, 4):
            for v in (2, 3):
                for m in _microbatches(p):
                    limits = (
                        (None, 1, max(1, p / 2), math.inf) if name == "interleaved-zb" else (None, v, p * v, math.inf)
                    )
                    for limit in dict.fromkeys(limits):
                        kwargs = {"v": v} if limit is None else {"v": v, "memory_limit": limit}
                        costs = "fbw-comm" if m == 2 * p else "none"
                        yield f"{name}/p{p}/m{m}/v{v}/mem{limit}/{costs}", name, p, m, kwargs, costs


class _NotCosts:
    def __repr__(self) -> str:
        return "NotCosts()"


def refusals() -> Iterator[tuple[str, str, int, int, dict[str, Any]]]:
    """Requests every schedule must refuse, ``(key, schedule, p, m, kwargs)``."""
    block = str(DATA / "block_p2.json")
    bad: list[tuple[str, int, int, dict[str, Any]]] = [
        ("p0", 0, 4, {}),
        ("m0", 2, 0, {}),
        ("p-float", 2.0, 4, {}),  # type: ignore[list-item]
        ("v1", 2, 4, {"v": 1}),
        ("v2", 2, 4, {"v": 2}),
        ("v3", 4, 8, {"v": 3}),
        ("v0", 2, 4, {"v": 0}),
        ("mem4", 2, 4, {"memory_limit": 4}),
        ("mem0", 2, 4, {"memory_limit": 0}),
        ("mem-str", 2, 4, {"memory_limit": "2p"}),
        ("costs", 2, 4, {"costs": Costs(1.0, 2.0, 1.0)}),
        ("costs-bad", 2, 4, {"costs": _NotCosts()}),
        ("block-file", 2, 4, {"block_file": block}),
        ("block-file-p4", 4, 4, {"block_file": block}),
        ("block-missing", 2, 4, {"block_file": str(DATA / "no-such-block.json")}),
        ("group", 2, 4, {"microbatch_group_size": 3}),
        ("group-big", 2, 4, {"v": 2, "microbatch_group_size": 5}),
        ("p1", 1, 4, {}),
        ("m-lt-p", 4, 2, {"v": 2}),
        ("unknown-kw", 2, 4, {"frobnicate": 1}),
    ]
    for name in RECORDED:
        for tag, p, m, kwargs in bad:
            yield f"{name}/{tag}", name, p, m, kwargs


def _costs(name: str, num_stages: int) -> Costs | None:
    return _per_stage(num_stages) if name == "per-stage" else COSTS[name]


def _num(x: float) -> float | str:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return float(f"{x:.9g}")


def _plain(value: Any) -> Any:
    if isinstance(value, float):
        return _num(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, str) and value.startswith(str(DATA)):
        return Path(value).name
    return value


def record_case(name: str, p: int, m: int, kwargs: dict[str, Any], costs_name: str) -> dict[str, Any]:
    stages = {"v-zb": 2 * p}.get(name, p)
    costs = _costs(costs_name, stages)
    gen_kwargs = dict(kwargs)
    if costs is not None:
        gen_kwargs["costs"] = costs
    schedule = generate(name, p, m, **gen_kwargs)
    sim = simulate(schedule, costs if costs is not None else Costs.unit())
    return {
        "ops": [" ".join(map(str, row)) for row in schedule.ops],
        "placement": schedule.placement.to_spec(),
        "params": _plain(schedule.params),
        "sim": {
            "makespan": _num(sim.makespan),
            "bubble_rate": _num(sim.bubble_rate),
            "sync_bubble_rate": _num(sim.sync_bubble_rate),
            "peak": _plain(sim.peak_activations_1f1b_units),
            "span": _plain(sim.span),
        },
    }


def record_refusal(name: str, p: int, m: int, kwargs: dict[str, Any]) -> str:
    try:
        generate(name, p, m, **kwargs)
    except (ScheduleError, ValueError, TypeError) as exc:
        return f"{type(exc).__name__}: {exc}".replace(str(DATA) + "/", "")
    return "accepted"


def record() -> dict[str, Any]:
    out: dict[str, Any] = {"cases": {}, "refusals": {}}
    for key, name, p, m, kwargs, costs in cases():
        out["cases"][key] = record_case(name, p, m, kwargs, costs)
    for key, name, p, m, kwargs in refusals():
        out["refusals"][key] = record_refusal(name, p, m, kwargs)
    return out


def load() -> dict[str, Any]:
    with gzip.open(GOLDEN, "rt") as f:
        data: dict[str, Any] = json.load(f)
    return data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="rewrite data/golden.json.gz from the current code")
    args = parser.parse_args()
    data = record()
    print(f"{len(data['cases'])} cases, {len(data['refusals'])} refusals")
    if args.write:
        with gzip.GzipFile(GOLDEN, "wb", mtime=0) as raw:
            raw.write(json.dumps(data, sort_keys=True, separators=(",", ":")).encode())
        print(f"wrote {GOLDEN} ({GOLDEN.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
