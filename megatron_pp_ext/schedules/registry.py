"""Schedules registered by name; lookup is case-insensitive.

A schedule registers a :class:`ScheduleInfo`: its generator, placement, whether it splits the
backward, and its :class:`~.capabilities.Capabilities` (what parameters it takes, as data).
:func:`generate` checks a request against those declarations (:func:`~.capabilities.check_request`)
before the generator runs, so generators do not repeat the common checks.

:func:`generate` is the one way to build a schedule by name. A keyword value that a layer above this
package decides (zeropp's ``unit_size="auto"``, chosen with the simulator) reaches it through a
:func:`register_chooser` made by that layer (:mod:`megatron_pp_ext.analysis.zeropp_auto`, registered when
:mod:`megatron_pp_ext.analysis` is imported): the request is checked here as any other, then the chooser
builds the schedule instead of the generator.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .capabilities import Capabilities, check_request
from .gc_pause import cyclic_gc_paused
from .ir import ScheduleError
from .limits import check_ops
from .schedule import Schedule

Generator = Callable[..., Schedule]
Chooser = Callable[["ScheduleInfo", int, int, dict[str, object]], Schedule]
"""``chooser(info, p, m, checked)``: the schedule for a checked request whose keyword says ``"auto"``."""


class UnknownScheduleError(ScheduleError):
    """A schedule name that is not registered."""


@dataclass(frozen=True)
class ScheduleInfo:
    """A registered schedule. ``constraints``: rules beyond the declared parameters, in words.
    ``capabilities``: the declared parameters (default: one chunk per rank, no further keywords)."""

    name: str
    generate: Generator
    placement: str  # loop | v | bidirectional
    splits_backward: bool  # uses B/W ops (needs the weight-gradient store)
    constraints: str
    description: str
    family: str = "baseline"
    capabilities: Capabilities = field(default_factory=Capabilities)

    def takes(self, keyword: str) -> bool:
        """Whether the generator reads ``keyword`` (``costs``, ``memory_limit``, ``block_file``, ``v``
        when it chooses the chunks, or one of its further keywords)."""
        return self.capabilities.takes(keyword)

    @property
    def requirements(self) -> str:
        """Declared parameters and the further rules, in one line."""
        declared = self.capabilities.describe()
        said = {item.strip() for item in declared.split(", ")}
        # the generator's own text without what the declaration already says (p >= 1, m >= 1, v ...)
        further = ", ".join(item for item in self.constraints.split(", ") if item.strip() not in said)
        return f"{declared}; {further}" if further else declared

    def check(self, p: object, m: object, **kwargs: object) -> dict[str, object]:
        """Check a request against the declarations; the keyword arguments the generator takes."""
        return check_request(self.name, self.capabilities, p, m, kwargs)

    def check_size(self, p: int, m: int, v: object) -> None:
        """Refuse a request over :data:`.limits.MAX_OPS` before the generator sizes anything by it."""
        chunks = v if isinstance(v, int) else self.capabilities.chunks.default
        check_ops(p, m, max(int(chunks), 1))

    def build(self, p: int, m: int, **kwargs: object) -> Schedule:
        """Check the request, then generate (or let a registered chooser decide an ``"auto"`` value)."""
        checked = self.check(p, m, **kwargs)
        self.check_size(p, m, checked.get("v", kwargs.get("v")))
        chooser = _chooser_for(self.name, checked)
        with cyclic_gc_paused():
            if chooser is not None:
                return chooser(self, p, m, checked)
            return self.generate(p, m, **checked)


_REGISTRY: dict[str, ScheduleInfo] = {}
_CHOOSERS: dict[tuple[str, str], Chooser] = {}


def register_chooser(name: str, keyword: str, chooser: Chooser) -> None:
    """Schedule ``name`` built with ``keyword="auto"`` is built by ``chooser`` (from a layer above this
    package: the schedules package never simulates)."""
    _CHOOSERS[(name.lower(), keyword)] = chooser


def _chooser_for(name: str, checked: dict[str, object]) -> Chooser | None:
    for (schedule, keyword), chooser in _CHOOSERS.items():
        value = checked.get(keyword)
        if schedule == name.lower() and isinstance(value, str) and value.strip().lower() == "auto":
            return chooser
    return None


def register(info: ScheduleInfo) -> ScheduleInfo:
    _REGISTRY[info.name.lower()] = info
    return info


def _ensure_loaded() -> None:
    from . import generators  # noqa: F401  (registers the built-in schedules)


def names() -> list[str]:
    _ensure_loaded()
    return sorted(_REGISTRY)


def get(name: str) -> ScheduleInfo:
    _ensure_loaded()
    info = _REGISTRY.get(str(name).strip().lower())
    if info is None:
        raise UnknownScheduleError(f"unknown pipeline schedule {name!r}; valid schedules: {', '.join(names())}")
    return info


def generate(name: str, p: int, m: int, **kwargs: object) -> Schedule:
    """Build schedule ``name`` for ``p`` ranks and ``m`` micro-batches."""
    return get(name).build(p, m, **kwargs)
