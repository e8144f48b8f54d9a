"""What a schedule takes, declared as data, and the one check of a request against it.

Every registered schedule declares its :class:`Capabilities` (``ScheduleInfo.capabilities``):
the chunks per rank ``v`` it runs, whether it takes a memory limit (and in which units) or has a
fixed memory, whether it reads costs or a building-block file, further keywords, the smallest
``p`` and ``m``, and what it needs from data parallelism. :func:`check_request` checks a request
against the declaration and raises :class:`ScheduleParameterError` naming the parameter and the
valid range; it returns the keyword arguments the generator receives. The CLI, the planner and
the Megatron flags read the declarations instead of the generators' signatures.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from .ir import ScheduleError

__all__ = [
    "Capabilities",
    "Chunks",
    "DataParallel",
    "MemoryLimit",
    "ScheduleParameterError",
    "check_int",
    "check_request",
    "reject_unsupported",
]


class ScheduleParameterError(ScheduleError):
    """Parameters a schedule cannot be built for (names the parameter and the valid range)."""


def check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScheduleParameterError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value < minimum:
        raise ScheduleParameterError(f"{name} must be >= {minimum}, got {value}")
    return value


def reject_unsupported(schedule: str, unused: Mapping[str, object]) -> None:
    """Raise if a keyword the schedule does not take was given a value (not ``None``)."""
    given = sorted(k for k, value in unused.items() if value is not None)
    if given:
        raise ScheduleParameterError(
            f"{schedule} does not take parameter(s) {', '.join(given)} "
            f"(got {', '.join(f'{k}={unused[k]!r}' for k in given)})"
        )


@dataclass(frozen=True)
class Chunks:
    """Chunks per rank (``v``): ``low`` to ``high`` (``None``: no upper bound), ``default`` when not
    given. ``refusal`` is the message for another ``v``; it may use ``{name}`` and ``{v}``."""

    low: int = 1
    high: int | None = 1
    default: int = 1
    refusal: str = "{name} runs one chunk per rank: v must be 1 (or not given), got {v!r}"

    @property
    def fixed(self) -> bool:
        return self.high == self.low

    def accepts(self, v: int) -> bool:
        return self.low <= v and (self.high is None or v <= self.high)

    def describe(self) -> str:
        if self.fixed:
            return f"v = {self.low}"
        top = "" if self.high is None else f" and <= {self.high}"
        return f"v >= {self.low}{top} (default {self.default})"


@dataclass(frozen=True)
class MemoryLimit:
    """A schedule that builds within ``memory_limit``: its ``unit`` (``activation``: one stage's
    activation for one micro-batch; ``M_a``: one 1F1B stage's), the default as a multiple of ``p``,
    the least limit that can work and ``why``."""

    unit: str
    units: str
    default_per_rank: float
    minimum: float = 1.0
    why: str = ""

    @property
    def default(self) -> str:
        k = self.default_per_rank
        if math.isinf(k):
            return "none"
        return "p" if k == 1 else f"{k:g}p"

    def describe(self) -> str:
        return f"memory_limit >= {self.minimum:g} {self.units} (default {self.default})"


@dataclass(frozen=True)
class DataParallel:
    """What a schedule needs from data parallelism: a least data-parallel size, and whether its
    collectives shard parameters (FSDP): ``no`` (plain replicas), ``optional`` or ``required``."""

    min_size: int = 1
    fsdp: str = "no"

    def describe(self) -> str:
        parts = [f"data-parallel >= {self.min_size}"] if self.min_size > 1 else []
        if self.fsdp != "no":
            parts.append(f"FSDP {self.fsdp}")
        return ", ".join(parts)


@dataclass(frozen=True)
class Capabilities:
    """Everything a schedule accepts (see the module doc).

    ``fixed_memory``: for a schedule without ``memory_limit``, the refusal of one (``{name}``,
    ``{limit}``), naming its fixed peak and the schedule to use instead; ``None`` refuses it as an
    unsupported parameter. ``too_few_ranks``: the refusal of ``p < min_p`` (``{name}``, ``{p}``,
    ``{min_p}``). ``keywords``: further keyword parameters the generator takes.
    """

    chunks: Chunks = field(default_factory=Chunks)
    memory_limit: MemoryLimit | None = None
    fixed_memory: str | None = None
    costs: bool = False
    block_file: bool = False
    keywords: tuple[str, ...] = ()
    min_p: int = 1
    too_few_ranks: str = "{name} needs p >= {min_p} ranks, got p={p}"
    min_m: int = 1
    data_parallel: DataParallel = field(default_factory=DataParallel)

    def takes(self, keyword: str) -> bool:
        """Whether the generator reads ``keyword`` (``v`` for a schedule with a choice of chunks)."""
        if keyword == "v":
            return not self.chunks.fixed
        if keyword in ("memory_limit", "costs", "block_file"):
            return bool(getattr(self, keyword))
        return keyword in self.keywords

    def describe(self) -> str:
        """The declared parameters in one line (``megatron-pp list``)."""
        parts = [f"p >= {self.min_p}", f"m >= {self.min_m}", self.chunks.describe()]
        if self.memory_limit is not None:
            parts.append(self.memory_limit.describe())
        if self.costs:
            parts.append("costs")
        if self.block_file:
            parts.append("block_file")
        parts += self.keywords
        dp = self.data_parallel.describe()
        return ", ".join(parts + ([dp] if dp else []))


def _check_memory_limit(name: str, spec: MemoryLimit, limit: object, p: int) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int | float) or math.isnan(limit):
        example = spec.default_per_rank * p
        raise ScheduleParameterError(
            f"memory_limit must be a number of {spec.units} >= {spec.minimum:g} "
            f"(e.g. {spec.default} = {example:g}), got {limit!r}"
        )
    if limit < spec.minimum:
        raise ScheduleParameterError(
            f"{name} needs memory_limit >= {spec.minimum:g} {spec.unit}: {spec.why}, got {limit!r}"
        )


def check_request(
    name: str,
    caps: Capabilities,
    p: object,
    m: object,
    kwargs: Mapping[str, object],
    *,
    data_parallel: int | None = None,
    fsdp: bool = False,
) -> dict[str, object]:
    """Check building schedule ``name`` (declared ``caps``) for ``p`` ranks and ``m`` micro-batches
    with ``kwargs`` (``None`` = not given); raise :class:`ScheduleParameterError` or return the
    keyword arguments its generator takes (``v`` resolved to the default when it has a choice)."""
    check_int("p", p, 1)
    check_int("m", m, 1)
    assert isinstance(p, int) and isinstance(m, int)
    if p < caps.min_p:
        raise ScheduleParameterError(caps.too_few_ranks.format(name=name, p=p, min_p=caps.min_p))
    if m < caps.min_m:
        raise ScheduleParameterError(f"{name} needs m >= {caps.min_m} micro-batches, got m={m}")
    rest = {k: value for k, value in kwargs.items() if value is not None}
    out: dict[str, object] = {}
    chunks = caps.chunks
    v = rest.pop("v", None)
    if v is not None:
        check_int("v", v, 1)
        assert isinstance(v, int)
        if not chunks.accepts(v):
            raise ScheduleParameterError(chunks.refusal.format(name=name, v=v))
    if not chunks.fixed:
        out["v"] = chunks.default if v is None else v
    limit = rest.pop("memory_limit", None)
    if limit is not None:
        if caps.memory_limit is not None:
            _check_memory_limit(name, caps.memory_limit, limit, p)
            out["memory_limit"] = limit
        elif caps.fixed_memory is not None:
            raise ScheduleParameterError(caps.fixed_memory.format(name=name, limit=limit))
        else:
            rest["memory_limit"] = limit  # refused below, with the other unsupported ones
    for key in ("costs", "block_file", *caps.keywords):
        if key in rest and caps.takes(key):
            out[key] = rest.pop(key)
    reject_unsupported(name, rest)
    dp = caps.data_parallel
    if data_parallel is not None and data_parallel < dp.min_size:
        raise ScheduleParameterError(f"{name} needs data-parallel size >= {dp.min_size}, got {data_parallel}")
    if fsdp and dp.fsdp == "no":
        raise ScheduleParameterError(f"{name} does not shard parameters (FSDP) inside the pipeline")
    if not fsdp and dp.fsdp == "required":
        raise ScheduleParameterError(f"{name} needs FSDP (sharded parameters) inside the pipeline")
    return out
