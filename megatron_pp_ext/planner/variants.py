"""A schedule's variants at a pipeline shape: the chunk counts (``--virtual``), memory limit and unit sizes
(zeropp) it is built with, each with its layer split and its builds at the extrapolation anchors; or
the reasons why the schedule does not apply. Layer splits are checked before any schedule is built."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ..schedules import registry
from ..schedules.layer_split import LayerSplitError, placement_layer_counts
from ..schedules.placement import Placement
from ..schedules.schedule import Schedule
from ..schedules.values import parse_layer_layout, parse_memory_limit
from .extrapolate import anchor_counts
from .layer_layouts import fallback_split
from .memo import Built, build_key
from .memory import split_layers
from .space import divisors

if TYPE_CHECKING:
    from .search import Planner


@dataclass
class Variant:
    name: str
    v: int | None  # the v passed to the generator (None: its default)
    limit: str | None
    costs_key: tuple[float, ...] | None
    chunks: int
    split: tuple[int, ...]
    schedule: Schedule  # the largest simulated one (placement, chunks)
    builds: list[tuple[int, Built, tuple[Any, ...]]]  # (m, validated schedule, cache key): 1 or 2 anchors
    unit: int | None = None  # unit size U of the row (zeropp), None for schedules without one
    unit_arg: int | None = None  # the unit size passed to the generator (None: its default, U = m)


def feasible_chunks(planner: Planner, style: str, p: int) -> list[int] | None:
    """Chunk counts whose stages the layers split over (``None``: any, the style is unknown); with the layout
    search (``--layer-split search``) every count with at most one stage per layer, embedding and loss."""
    layers = planner.model.num_layers
    if planner.space.given_split is not None:  # a run's own split: each variant maps it or says why not
        return None
    if planner.space.layout is not None:  # a given layout: the chunk count whose stages it has
        stages = len(parse_layer_layout(planner.space.layout))
        if style in ("v", "bidirectional"):
            return [2] if stages == 2 * p else []
        return [c for c in sorted({1, *planner.space.virtual}) if p * c == stages] if style == "loop" else None
    if planner.space.layer_split == "search":
        if style in ("v", "bidirectional"):
            return [2] if 2 * p - 2 <= layers else []
        return [c for c in sorted({1, *planner.space.virtual}) if p * c <= layers + 2] if style == "loop" else None
    if style in ("v", "bidirectional"):  # megatron's uneven-stage options apply to their slices too
        return [2] if split_layers(layers, 2 * p, planner.space.layer_split) is not None else []
    if style == "loop":
        options = sorted({1, *planner.space.virtual})
        return [c for c in options if split_layers(layers, p * c, planner.space.layer_split) is not None]
    return None


def schedule_variants(
    planner: Planner, name: str, p: int, m: int, limit: str | None, t: int, d: int, b: int
) -> list[Variant | str]:
    """The chunk-count variants of schedule ``name`` at ``(p, m)``, or the reasons why not."""
    info = registry.get(name)
    feasible = feasible_chunks(planner, info.placement, p)
    if feasible == []:
        stages = 2 * p if info.placement in ("v", "bidirectional") else p
        return [
            f"{planner.model.num_layers} layers do not split over the stages of a {info.placement} placement "
            f"on {p} ranks ({stages}{'' if info.placement != 'loop' else ' x chunks'})"
        ]
    costs_key = generator_costs(planner, t, p, d, b) if info.takes("costs") else None
    anchors = anchor_counts(p, m)

    def build_all(v: int | None) -> list[tuple[int, Built, tuple[Any, ...]]] | str:
        out = []
        for mm in anchors:
            built = planner.build(name, p, mm, v, limit, costs_key)
            if built.schedule is None and mm != m:  # an anchor refused: judge (and name) the real m
                built, mm = planner.build(name, p, m, v, limit, costs_key), m
                if built.schedule is not None:
                    return [(m, built, (name, p, m, v, limit, costs_key))]
            if built.schedule is None:
                return short(built.error)
            out.append((mm, built, (name, p, mm, v, limit, costs_key)))
        return out

    base = build_all(None)
    if isinstance(base, str):
        return [base]
    first = base[0][1].schedule
    assert first is not None
    default_chunks = first.chunks_per_rank
    options: list[tuple[int | None, list[tuple[int, Built, tuple[Any, ...]]]]] = [(None, base)]
    if first.placement.style == "loop":
        declared = info.capabilities
        for chunks_v in planner.space.virtual:
            if chunks_v == default_chunks or (feasible is not None and chunks_v not in feasible):
                continue
            if declared is not None and not declared.chunks.accepts(chunks_v):
                continue  # the schedule declares it does not run v chunks
            built_v = build_all(chunks_v)
            if not isinstance(built_v, str):
                options.append((chunks_v, built_v))
    out: list[Variant | str] = []
    for v, builds in options:
        sched = builds[-1][1].schedule
        assert sched is not None
        placement = sched.placement
        chunks = sched.chunks_per_rank
        if v is None and placement.style == "loop" and chunks not in planner.space.virtual:
            continue
        split = variant_split(planner, placement)
        if isinstance(split, str):
            out.append(split)
            continue
        if split is None:
            out.append(
                f"{planner.model.num_layers} layers do not split over {placement.stages_per_replica} stages "
                f"({placement.style} placement, {chunks} chunk(s) per rank)"
            )
            continue
        out.append(Variant(name, v, limit, costs_key, chunks, tuple(split), sched, builds))
    if not out:
        out.append(f"no chunk count in {planner.space.virtual} applies")
    if info.takes("unit_size"):
        return unit_variants(planner, out, name, p, m, limit, costs_key)
    return out


def variant_split(planner: Planner, placement: Placement) -> tuple[int, ...] | str | None:
    """A variant's layer split: a run's own (``SearchSpace.given_split``, megatron's flags as ``placement``
    maps them, or why it cannot); else the policy's (``--layer-split``); with the layout search the uniform
    split when there is one, else a placeholder (:func:`.layer_layouts.fallback_split`) that the search replaces."""
    layers, slices = planner.model.num_layers, placement.stages_per_replica
    if planner.space.given_split is not None:
        try:
            return tuple(placement_layer_counts(layers, placement, planner.space.given_split))
        except LayerSplitError as exc:
            return f"the run's layer split does not map onto its {placement.style} placement: {exc}"
    if planner.space.layer_split == "search":
        return split_layers(layers, slices, "auto") or fallback_split(layers, placement)
    return split_layers(layers, slices, planner.space.layer_split)


def unit_variants(
    planner: Planner,
    variants: list[Variant | str],
    name: str,
    p: int,
    m: int,
    limit: str | None,
    costs_key: tuple[float, ...] | None,
) -> list[Variant | str]:
    """Each variant once per unit size ``U`` (``SearchSpace.unit_sizes``, default every divisor of
    ``m``): ``U = m`` is the schedule's default (simulated at the anchors), any other ``U`` is
    built and simulated at ``m`` itself (its units do not scale with the anchors)."""
    sizes = [u for u in (planner.space.unit_sizes or divisors(m)) if 1 <= u <= m and m % u == 0]
    out: list[Variant | str] = []
    for var in variants:
        if isinstance(var, str):
            out.append(var)
            continue
        for unit in sizes:
            if unit == m:
                out.append(replace(var, unit=m))
                continue
            built = planner.build(name, p, m, var.v, limit, costs_key, unit)
            if built.schedule is None:
                out.append(short(built.error))
                continue
            key = build_key(name, p, m, var.v, limit, costs_key, unit)
            out.append(replace(var, unit=unit, unit_arg=unit, schedule=built.schedule, builds=[(m, built, key)]))
    if not out:
        out.append(f"no unit size divides m={m} in {planner.space.unit_sizes}")
    return out


def generator_costs(planner: Planner, t: int, p: int, d: int, b: int) -> tuple[float, float, float, float]:
    """Relative ``F, B, W, COMM`` of an average stage (what ``--pipeline-costs`` passes), rounded
    so that cost-aware generators are rebuilt only when the ratios really change."""
    lt = planner.costs.layer_times(b, t, "none")
    cf, cb = planner.costs.tp_comm_per_layer(b, t)
    f, bb, w = lt.f + cf, lt.b + cb, lt.w
    comm = planner.costs.p2p_time(b, t, p, d)
    layers = max(1.0, planner.model.num_layers / p)
    return (1.0, round(bb / f, 1), round(w / f, 1), quantise_comm(comm / (f * layers)))


_COMM_STEPS = (0.0, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


def quantise_comm(ratio: float) -> float:
    """The nearest of a few relative p2p costs (a cost-aware generator is rebuilt per distinct
    value; its order barely changes between neighbours)."""
    return min(_COMM_STEPS, key=lambda x: abs(x - ratio))


def resolve_limit(limit: str | None, p: int) -> float | int | None:
    """A memory limit's text (``"2p"``, ``"12"``) as activations at pipeline size ``p``."""
    return None if limit is None else parse_memory_limit(limit).resolve(p)


def first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


def short(reason: str | None, limit: int = 160) -> str:
    text = reason or "not applicable"
    # Numbers differ per configuration; keep the reason readable and groupable.
    return text if len(text) <= limit else text[: limit - 3] + "..."
