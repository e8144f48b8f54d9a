"""Write a snapshot of exact figures, or check the current ones against one (the before/after comparisons
of benchmarks/compare_timing.py and benchmarks/compare_vzb_candidates.py)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any


def write_or_check(
    description: str,
    collect: Callable[[], dict[str, Any]],
    noun: str,
    summary: Callable[[dict[str, Any]], str] = lambda now: "",
) -> None:
    """``--write FILE``: store ``collect()``; ``--check FILE``: print the keys that differ from the stored
    snapshot and exit 1 if any does. ``collect()`` must give what ``json.load`` gives back (JSON types);
    ``summary(now)`` is printed after the count."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write", metavar="FILE")
    group.add_argument("--check", metavar="FILE")
    args = parser.parse_args()
    now = collect()
    if args.write:
        with open(args.write, "w") as f:
            json.dump(now, f)
        print(f"wrote {len(now)} {noun} to {args.write}")
        return
    with open(args.check) as f:
        before = json.load(f)
    differ = sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
    for key in differ[:20]:
        print(f"differs: {key}")
    print(f"{len(now)} {noun}{summary(now)}, {len(differ)} differ")
    sys.exit(1 if differ else 0)
