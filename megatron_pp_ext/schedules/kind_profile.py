"""Per-layer-kind times from a measured per-stage profile, where the stages' layers determine them.

A stage's forward (backward, weight gradient) time is the sum of its layers' plus the embedding on the first
model stage and the output layer + loss (``head``) on the last. Stages that hold different mixes of kinds make
that a linear system in the per-kind times; :func:`kind_times` solves it by least squares (the times are
noisy) when its columns are independent, and gives up (``None``) otherwise: e.g. a dense GPT split evenly over
two stages has three unknowns (``dense``, ``embedding``, ``head``) and two equations, over three or more stages
the middle ones give ``dense`` and the ends their excess. :func:`layer_costs_text` writes the result in the
``KIND=F,B,W;...`` text of ``--pipeline-costs`` (:func:`.values.parse_layer_costs` reads it back);
:func:`stage_times` goes the other way: per-kind times summed into each stage's (a named schedule given per-kind
costs is built with them).

Pure Python (a few unknowns: normal equations and Gaussian elimination).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

from .layer_split import LayerSplit, placement_layer_counts
from .placement import Placement

__all__ = ["kind_times", "layer_costs_text", "stage_kind_counts", "stage_times"]

_RANK_TOLERANCE = 1e-9


def stage_kind_counts(
    layer_kinds: Sequence[str], placement: Placement, split: LayerSplit | None = None
) -> list[Counter[str]]:
    """Per global stage of ``placement``: how many layers of each kind it runs, ``embedding`` on the first
    model stage and ``head`` on the last (``layer_kinds``: the decoder layers in model order)."""
    counts = placement_layer_counts(len(layer_kinds), placement, split)
    slices: list[Counter[str]] = []
    offset = 0
    for i, n in enumerate(counts):
        kinds = Counter(layer_kinds[offset : offset + n])
        offset += n
        if i == 0:
            kinds["embedding"] += 1
        if i == len(counts) - 1:
            kinds["head"] += 1
        slices.append(kinds)
    return [slices[placement.model_slice_of(s)] for s in range(placement.num_stages)]


def _solve(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """``matrix x = rhs`` (square) by Gaussian elimination with partial pivoting; ``None`` when singular."""
    n = len(rhs)
    a = [[*row, b] for row, b in zip(matrix, rhs, strict=True)]
    scale = max((abs(x) for row in matrix for x in row), default=0.0) or 1.0
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) <= _RANK_TOLERANCE * scale:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                factor = a[r][col] / a[col][col]
                a[r] = [x - factor * y for x, y in zip(a[r], a[col], strict=True)]
    return [a[i][n] / a[i][i] for i in range(n)]


def kind_times(
    stage_kinds: Sequence[Counter[str]], times: Sequence[Sequence[float]]
) -> dict[str, tuple[float, ...]] | None:
    """Each kind's times (one per column of ``times``, e.g. F, B, W) fitted to the stages' measured times
    (``times[s]``: stage ``s``); ``None`` when the stages do not determine every kind. Negative fits (noise
    around a kind that costs nothing) are clamped to 0."""
    kinds = sorted({k for counts in stage_kinds for k in counts})
    if not kinds or len(stage_kinds) != len(times):
        return None
    rows = [[float(counts[k]) for k in kinds] for counts in stage_kinds]
    normal = [[sum(r[i] * r[j] for r in rows) for j in range(len(kinds))] for i in range(len(kinds))]
    out: list[list[float]] = []
    for column in range(len(times[0])):
        rhs = [sum(r[i] * float(t[column]) for r, t in zip(rows, times, strict=True)) for i in range(len(kinds))]
        solved = _solve(normal, rhs)
        if solved is None:
            return None
        out.append([max(0.0, x) for x in solved])
    return {k: tuple(values[i] for values in out) for i, k in enumerate(kinds)}


def layer_costs_text(times: dict[str, tuple[float, ...]], micro_batch: int, tensor_parallel: int) -> str:
    """``KIND=F,B,W;...;micro_batch=N;tp=N`` from per-kind times in seconds (the text is in milliseconds)."""
    cells = [f"{k}=" + ",".join(f"{x * 1e3:.6g}" for x in v) for k, v in sorted(times.items())]
    return ";".join([*cells, f"micro_batch={int(micro_batch)}", f"tp={int(tensor_parallel)}"])


def stage_times(
    stage_kinds: Sequence[Counter[str]], per_kind: Mapping[str, Sequence[float]]
) -> list[tuple[float, ...]]:
    """Each stage's times (one per column of ``per_kind``'s entries, e.g. F, B, W): the sum over its layers of
    their kind's times, the inverse of :func:`kind_times`. ValueError naming the kinds ``per_kind`` lacks."""
    held = sorted({k for counts in stage_kinds for k, n in counts.items() if n})
    missing = [k for k in held if k not in per_kind]
    if missing:
        raise ValueError(f"no times for layer kind(s) {', '.join(missing)} (the stages hold {', '.join(held)})")
    width = len(next(iter(per_kind.values()))) if per_kind else 0
    return [
        tuple(sum(n * float(per_kind[k][i]) for k, n in counts.items() if n) for i in range(width))
        for counts in stage_kinds
    ]
