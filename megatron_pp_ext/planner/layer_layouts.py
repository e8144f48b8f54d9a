"""Layer placement as a search axis: which layers each pipeline stage holds, written as megatron's flags.

A *layout* is the number of decoder layers of each model slice (model order), with the embedding in
the first slice and the output layer + loss in the last, as megatron builds them; a slice may hold the
embedding or the loss alone (``E|t*8|...|t*8|L``) but never nothing. The planner tries, per candidate
(schedule, PP, chunks, micro-batch, ...), at most :data:`MAX_CANDIDATES` layouts and keeps the fastest
that fits the memory budget (:func:`candidate_splits`):

* **loop placements** (megatron's own stage order): the exact min-max partition of the sequence
  ``embedding, layers..., head`` (each item weighted by its ``F + B + W``) into the ``p * v`` slices
  (:func:`min_max_partition`: binary search over the sums of contiguous runs with a greedy check,
  ``O(n^2 log n)`` for ``n`` layers), packed from the front and from the back (the same bottleneck,
  different slices), plus the best layout of the first/last family below;
* **any placement** (V, bidirectional, loop): the first/last family, middle slices even (megatron's
  ``--decoder-first/last-pipeline-num-layers``), searched exactly for the smallest busiest *rank* (its
  slices' sums; V puts slices ``i`` and ``2p-1-i`` on one rank, so the embedding and the loss share rank 0);
  V and bidirectional placements take only this family (the flags their runtime maps).

Each candidate is then simulated with per-stage costs and the memory model; the even (or
embedding-and-loss) split is always among them, so a planned layout is never predicted slower than the
uniform one of the same search. Bound: the min-max partition is optimal for the busiest stage, not for
the simulated iteration (bubbles, memory); the few candidates around it are what the simulator judges.

Flags (:func:`layout_args`): loop placements get ``--pipeline-model-parallel-layout`` (megatron's text,
written out without repeats so a job script passes it as one plain word), the others
``--decoder-first/last-pipeline-num-layers``. A hybrid model (megatron's ``HybridModel``) takes its stage
boundaries as ``|`` in ``--hybrid-layer-pattern`` instead (:func:`hybrid_pattern_text`): megatron-core refuses
the layout, first/last and account-for flags and the virtual pipeline flag beside a pattern with ``|`` and
derives the chunks per rank from the segment count; the plugin's chunk of model stage ``s`` builds segment ``s``
under every placement (``docs/hybrid.md``). :func:`split_from_layout` reads a given layout and refuses,
in one line naming the stage, one that does not add up to the model's layers, leaves a stage empty, or
that the placement cannot map.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from ..schedules.placement import Placement, loop_placement
from ..schedules.values import parse_layer_layout
from .memory import split_layers, stage_layout

__all__ = [
    "MAX_CANDIDATES",
    "candidate_splits",
    "check_layout",
    "fallback_split",
    "first_last_split",
    "hybrid_pattern_text",
    "is_uniform",
    "layout_args",
    "layout_text",
    "min_max_partition",
    "rank_loads",
    "split_from_layout",
]

MAX_CANDIDATES = 4  # planned layouts simulated per candidate, besides the uniform split


def _fits(weights: Sequence[float], parts: int, bound: float) -> bool:
    """Whether ``weights`` cut into at most ``parts`` contiguous runs each summing to at most ``bound``."""
    used, acc = 1, 0.0
    for x in weights:
        if x > bound:
            return False
        if acc + x > bound:
            used, acc = used + 1, x
            if used > parts:
                return False
        else:
            acc += x
    return True


def min_max_partition(weights: Sequence[float], parts: int, from_back: bool = False) -> tuple[int, ...]:
    """Sizes of ``parts`` non-empty contiguous runs of ``weights`` whose largest sum is the smallest
    possible (exact). Runs are filled greedily from the front (or from the back) up to that bound; when
    that leaves fewer runs, the longest are split until there are ``parts``."""
    n = len(weights)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot cut {n} items into {parts} non-empty runs")
    prefix = [0.0]
    for x in weights:
        prefix.append(prefix[-1] + x)
    sums = sorted({prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1)})
    lo = bisect.bisect_left(sums, max(weights))
    hi = len(sums) - 1
    while lo < hi:  # the smallest contiguous sum that is a feasible bound
        mid = (lo + hi) // 2
        if _fits(weights, parts, sums[mid] * (1 + 1e-12)):
            hi = mid
        else:
            lo = mid + 1
    bound = sums[lo] * (1 + 1e-12)
    items = list(reversed(weights)) if from_back else list(weights)
    sizes: list[int] = []
    acc = 0.0
    for x in items:
        if sizes and acc + x <= bound:
            sizes[-1] += 1
            acc += x
        else:
            sizes.append(1)
            acc = x
    while len(sizes) < parts:  # split the longest run: never raises the bound
        i = max(range(len(sizes)), key=lambda k: sizes[k])
        sizes[i : i + 1] = [sizes[i] - 1, 1]
    return tuple(reversed(sizes)) if from_back else tuple(sizes)


def _split_of_runs(runs: Sequence[int]) -> tuple[int, ...]:
    """Runs over ``embedding, layers..., head`` as decoder layers per slice."""
    split = list(runs)
    split[0] -= 1
    split[-1] -= 1
    return tuple(split)


def rank_loads(placement: Placement, split: Sequence[int], slice_weights: Sequence[float]) -> list[float]:
    """Per rank, the summed weight of the slices it holds (``slice_weights`` per model slice)."""
    loads = [0.0] * placement.num_ranks
    for info in stage_layout(placement, split):
        loads[info.rank] += slice_weights[placement.model_slice_of(info.stage)]
    return loads


def _slice_weights(weights: Sequence[float], split: Sequence[int]) -> list[float]:
    """Per slice, the weight of its layers plus the embedding (first) and head (last): ``weights`` is
    ``embedding, layers..., head``."""
    out, offset = [], 1
    for i, n in enumerate(split):
        w = sum(weights[offset : offset + n]) + (weights[0] if i == 0 else 0.0)
        offset += n
        out.append(w + (weights[-1] if i == len(split) - 1 else 0.0))
    return out


def first_last_split(placement: Placement, weights: Sequence[float], keep: int = 1) -> list[tuple[int, ...]]:
    """The ``keep`` best layouts with the middle slices even and the first / last slices free (megatron's
    ``--decoder-first/last-pipeline-num-layers``), by the busiest rank's load (exact over the family;
    ``weights``: ``embedding, layers..., head``). Every slice holds something."""
    slices = placement.stages_per_replica
    layers = len(weights) - 2
    if slices == 1:
        return [(layers,)]
    scored: list[tuple[float, tuple[int, ...]]] = []
    middle = slices - 2
    for per in range(1 if middle else 0, (layers // middle if middle else 0) + 1):
        rest = layers - per * middle
        for first in range(rest + 1):
            split = (first,) + (per,) * middle + (rest - first,)
            loads = rank_loads(placement, split, _slice_weights(weights, split))
            scored.append((max(loads), split))
    scored.sort()
    return [split for _, split in scored[:keep]]


def candidate_splits(
    placement: Placement, weights: Sequence[float], uniform: tuple[int, ...] | None
) -> list[tuple[int, ...]]:
    """The layouts the planner simulates for one candidate (module doc): ``uniform`` (the even or
    embedding-and-loss split, when there is one) first, then at most :data:`MAX_CANDIDATES` planned ones."""
    slices = placement.stages_per_replica
    out: list[tuple[int, ...]] = [uniform] if uniform is not None else []
    if slices > len(weights):  # more stages than embedding + layers + head
        return out
    planned: list[tuple[int, ...]] = []
    if placement.style == "loop":
        planned += [_split_of_runs(min_max_partition(weights, slices, back)) for back in (False, True)]
        planned += first_last_split(placement, weights, 1)
    else:
        planned += first_last_split(placement, weights, 2)
    for split in planned:
        if split not in out and min(split[1:-1] or (1,)) >= 1:
            out.append(split)
    return out[: (1 if uniform is not None else 0) + MAX_CANDIDATES]


def fallback_split(num_layers: int, placement: Placement) -> tuple[int, ...] | None:
    """A layout for a placement whose stages the layers do not split over evenly: the min-max partition
    of equal weights (loop) or the first/last family's best (other placements); ``None`` if none exists."""
    weights = [1.0] * (num_layers + 2)
    if placement.stages_per_replica > len(weights):
        return None
    if placement.style == "loop":
        return _split_of_runs(min_max_partition(weights, placement.stages_per_replica))
    found = first_last_split(placement, weights, 1)
    return found[0] if found and min(found[0][1:-1] or (1,)) >= 1 else None


def is_uniform(num_layers: int, split: Sequence[int]) -> bool:
    """Whether ``split`` is a split policy's (even, or embedding and loss as one layer each: megatron's
    ``--account-for-embedding/loss-in-pipeline-split``)."""
    return any(tuple(split) == split_layers(num_layers, len(split), policy) for policy in ("even", "embedding-loss"))


def layout_text(split: Sequence[int], compact: bool = True) -> str:
    """Megatron's ``--pipeline-model-parallel-layout`` for ``split`` (slices in model order = megatron's
    stage order for loop placements); ``compact``: ``t*N`` repeats, else written out."""

    def run(n: int) -> str:
        return ("t*" + str(n) if n > 1 else "t" * n) if compact else "t" * n

    stages = [run(n) for n in split]
    stages[0] = "E" + stages[0]
    stages[-1] = stages[-1] + "L"
    return "|".join(stages)


def hybrid_pattern_text(pattern: str, split: Sequence[int]) -> str:
    """A hybrid model's layer pattern (one symbol per layer, no ``|``) cut into ``split``'s model slices:
    megatron's ``--hybrid-layer-pattern`` for that layout (slice ``i`` is segment ``i``)."""
    if sum(split) != len(pattern) or min(split, default=0) < 0:
        raise ValueError(f"layer split {tuple(split)} does not cut the {len(pattern)} layers of pattern {pattern!r}")
    segments, offset = [], 0
    for n in split:
        segments.append(pattern[offset : offset + n])
        offset += n
    return "|".join(segments)


def layout_args(placement_style: str, split: Sequence[int], hybrid_pattern: str | None = None) -> list[str]:
    """The megatron flags that build ``split`` (module doc); ``hybrid_pattern``: a hybrid model's pattern."""
    if hybrid_pattern is not None:
        return ["--hybrid-layer-pattern", hybrid_pattern_text(hybrid_pattern, split)]
    if placement_style == "loop":
        return ["--pipeline-model-parallel-layout", layout_text(split, compact=False)]
    return [
        "--decoder-first-pipeline-num-layers",
        str(split[0]),
        "--decoder-last-pipeline-num-layers",
        str(split[-1]),
    ]


def split_from_layout(text: str, num_layers: int, placement: Placement) -> tuple[int, ...]:
    """Decoder layers per model slice of a given layout (megatron's layout text), checked against the
    model and the placement; ValueError naming the stage otherwise."""
    stages = parse_layer_layout(text)
    slices = placement.stages_per_replica
    if len(stages) != slices:
        raise ValueError(
            f"layout has {len(stages)} stages, the {placement.style} placement on {placement.num_ranks} ranks "
            f"x {placement.chunks_per_rank} chunk(s) has {slices}"
        )
    for i, stage in enumerate(stages):
        if not stage:
            raise ValueError(f"layout stage {i} is empty: every stage of the schedule needs a layer, E or L")
        if "E" in stage and (i != 0 or stage.index("E") != 0 or stage.count("E") > 1):
            raise ValueError(f"layout stage {i}: the embedding E goes once, first in stage 0")
        if "L" in stage and (i != slices - 1 or not stage.endswith("L") or stage.count("L") > 1):
            raise ValueError(f"layout stage {i}: the loss L goes once, last in stage {slices - 1}")
    if not stages[0].startswith("E"):
        raise ValueError("layout stage 0 must start with the embedding E")
    if not stages[-1].endswith("L"):
        raise ValueError(f"layout stage {slices - 1} must end with the loss L")
    split = tuple(s.count("t") for s in stages)
    if sum(split) != num_layers:
        raise ValueError(f"layout holds {sum(split)} decoder layers (t), the model has {num_layers}")
    if placement.style != "loop" and slices > 2 and len(set(split[1:-1])) > 1:
        odd = next(i for i in range(2, slices - 1) if split[i] != split[1])
        raise ValueError(
            f"layout stage {odd}: a {placement.style} placement maps only layouts whose middle stages hold "
            f"the same number of layers ({split[1]} in stage 1, {split[odd]} here); only the first and last "
            "stages may differ (--decoder-first/last-pipeline-num-layers)"
        )
    return split


def check_layout(text: str, num_layers: int) -> tuple[int, ...]:
    """What a layout says regardless of the placement (its layer total, no empty stage, the embedding first
    and the loss last), as decoder layers per stage; ValueError naming the stage otherwise."""
    return split_from_layout(text, num_layers, loop_placement(len(parse_layer_layout(text))))
