"""The textual values a user gives a schedule, each read by exactly one parser.

The same value reaches the project through several doors: ``megatron-pp simulate --memory-limit``,
megatron's ``--pipeline-memory-limit``, the planner's ``--schedule-memory-limits``; ``--costs`` and
``--pipeline-costs``; ``--pipeline-unit-size`` on both command lines. Every door calls the parser
here, so a value means the same thing everywhere and is accepted or refused everywhere alike. The
parsers raise :class:`ValueError` with a message that names the valid range; each door adds its
flag name (argparse's ``argument --flag:``, the CLI's error line, megatron's error line).

The meanings (also in ``docs/flags.md``):

* memory limit: ``N`` activations of one stage for one micro-batch, or ``Np`` = N times the
  pipeline size p; ``p`` alone is ``1p``. N is a finite number in (0, 1e12].
* costs: ``F,B,W`` or ``F,B,W,COMM``: the times of one stage's forward, input-gradient backward,
  weight-gradient backward and of one p2p hop. All finite in [0, 1e12]; F and B must be > 0 (the
  planner and the simulator's cost ratios divide by them), W and COMM may be 0 (W = 0: weight
  gradients cost nothing, e.g. folded into B).
* all-to-all time: the time of one expert-parallel all-to-all (a dispatch or a combine) of one MoE
  layer for one micro-batch, in the unit of the costs it goes with (ms for the emulated bench); finite
  in [0, 1e12].
* MoE layers: ``N`` for every stage or ``N,N,...`` one per global stage, integers in [0, 100000].
* unit size: ``zeropp``'s scheduling unit, an integer number of micro-batches >= 1, or ``auto``.
* layer layout: megatron's ``--pipeline-model-parallel-layout`` string, stages separated by ``|``, one
  symbol per layer (``E`` embedding, ``t`` transformer layer, ``m`` multi-token prediction, ``L`` loss),
  ``X*n`` and ``(...)*n`` repeat, commas are cosmetic: ``"Et|(tt|)*2,tL"`` is 4 stages.
* layer costs: measured times of one layer of each kind for one micro-batch, ``KIND=F,B,W`` entries
  separated by ``;`` (kinds: ``dense``, ``moe``, ``mamba``, ``attention``, ``mlp``, ``moe-mlp``,
  ``embedding``, ``head`` = output layer + loss), optionally ``micro_batch=N`` and ``tp=N`` (what they
  were measured at, default 1); F, B, W in milliseconds, finite in [0, 1e12].

Pure Python, no torch.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = [
    "A2A_RULE",
    "COSTS_RULE",
    "HOST_COSTS_RULE",
    "LAYER_COSTS_RULE",
    "LAYER_COST_KINDS",
    "LAYER_LAYOUT_RULE",
    "MAX_VALUE",
    "MEMORY_LIMIT_RULE",
    "MOE_LAYERS_RULE",
    "UNIT_SIZE_RULE",
    "ActivationLimit",
    "parse_a2a_time",
    "parse_costs",
    "parse_host_costs",
    "parse_layer_costs",
    "parse_layer_layout",
    "parse_memory_limit",
    "parse_moe_layers",
    "parse_unit_size",
]

# The largest cost, time, size or memory limit a command takes: far beyond any real value, small enough
# that sums and products over a whole schedule stay finite (1e308 overflowed to inf).
MAX_VALUE = 1e12

MEMORY_LIMIT_RULE = (
    f"a number of activations in (0, {MAX_VALUE:g}] or a multiple of the pipeline size p like 2p (p = 1p)"
)
COSTS_RULE = f"F,B,W or F,B,W,COMM: finite numbers in [0, {MAX_VALUE:g}], F and B > 0"
A2A_RULE = f"the time of one all-to-all of one MoE layer: a finite number in [0, {MAX_VALUE:g}]"
MAX_MOE_LAYERS = 100_000
MOE_LAYERS_RULE = f"N or N,N,... (one per stage): MoE layers, integers in [0, {MAX_MOE_LAYERS}]"
UNIT_SIZE_RULE = "an integer number of micro-batches >= 1, or auto"
LAYER_LAYOUT_RULE = (
    "stages separated by |, layers E (embedding), t (transformer), m (MTP), L (loss); X*n and (...)*n repeat"
)

# A plain decimal number (no sign, no underscores, no hexadecimal, no inf / nan), then an optional ``p``.
_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?"
_MEMORY_RE = re.compile(rf"^\s*({_NUMBER})?\s*(p?)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class ActivationLimit:
    """A parsed memory limit: ``value`` activations, or ``value * p`` when ``per_rank_count`` (what a
    schedule may be given; :class:`.capabilities.MemoryLimit` is what a schedule declares it accepts)."""

    value: float
    per_rank_count: bool = False

    def resolve(self, num_ranks: int) -> int | float:
        """Activations at pipeline size ``num_ranks`` (an int when integral, as generators print it)."""
        total = self.value * num_ranks if self.per_rank_count else self.value
        return int(total) if float(total).is_integer() else total

    def __str__(self) -> str:
        text = f"{self.value:g}"
        return text + "p" if self.per_rank_count else text


def parse_memory_limit(text: str) -> ActivationLimit:
    """``"12"``, ``"1.5"``, ``"2p"``, ``"p"`` (= ``1p``); case and spaces do not matter."""
    match = _MEMORY_RE.match(str(text))
    if match is None or not (match.group(1) or match.group(2)):
        raise ValueError(f"expected {MEMORY_LIMIT_RULE}, got {text!r}")
    value = float(match.group(1)) if match.group(1) else 1.0
    if not (0 < value <= MAX_VALUE):
        raise ValueError(f"memory limit must be {MEMORY_LIMIT_RULE}, got {text!r}")
    return ActivationLimit(value, bool(match.group(2)))


def parse_costs(text: str) -> tuple[float, float, float, float]:
    """``"F,B,W"`` or ``"F,B,W,COMM"`` as ``(F, B, W, COMM)`` (COMM 0 when left out)."""
    cells = [c.strip() for c in str(text).split(",")]
    if len(cells) not in (3, 4):
        raise ValueError(f"costs must be 3 or 4 comma-separated numbers F,B,W[,COMM], got {text!r}")
    try:
        values = [float(c) for c in cells]
    except ValueError:
        raise ValueError(f"costs must be 3 or 4 comma-separated numbers F,B,W[,COMM], got {text!r}") from None
    if any(not (math.isfinite(v) and 0 <= v <= MAX_VALUE) for v in values) or values[0] <= 0 or values[1] <= 0:
        raise ValueError(
            f"costs F,B,W[,COMM] must be finite numbers in [0, {MAX_VALUE:g}] with F and B > 0, got {text!r}"
        )
    if len(values) == 3:
        values.append(0.0)
    return values[0], values[1], values[2], values[3]


def parse_a2a_time(text: str) -> float:
    """``"2.5"``: one all-to-all's time (dispatch or combine of one MoE layer)."""
    try:
        value = float(str(text).strip())
    except ValueError:
        raise ValueError(f"expected {A2A_RULE}, got {text!r}") from None
    if not (math.isfinite(value) and 0 <= value <= MAX_VALUE):
        raise ValueError(f"expected {A2A_RULE}, got {text!r}")
    return value


HOST_COSTS_RULE = f"PER_OP[,PER_EXCHANGE]: host times >= 0 and <= {MAX_VALUE:g}, in the unit of the op costs"


def parse_host_costs(text: str) -> tuple[float, float]:
    """``"0.2"`` or ``"0.2,0.3"``: the host time every op pays and the time a sender pays per exchange to
    another rank (0 when not given)."""
    cells = [c.strip() for c in str(text).split(",")]
    try:
        values = [float(c) for c in cells]
    except ValueError:
        raise ValueError(f"expected {HOST_COSTS_RULE}, got {text!r}") from None
    if not 1 <= len(values) <= 2 or not all(math.isfinite(v) and 0 <= v <= MAX_VALUE for v in values):
        raise ValueError(f"expected {HOST_COSTS_RULE}, got {text!r}")
    return values[0], values[1] if len(values) == 2 else 0.0


def parse_moe_layers(text: str) -> int | tuple[int, ...]:
    """``"4"`` (every stage) or ``"3,4,4,4"`` (one per global stage) MoE layers."""
    cells = [c.strip() for c in str(text).split(",")]
    try:
        values = [int(c) for c in cells]
    except ValueError:
        raise ValueError(f"expected {MOE_LAYERS_RULE}, got {text!r}") from None
    if any(not 0 <= v <= MAX_MOE_LAYERS for v in values):
        raise ValueError(f"expected {MOE_LAYERS_RULE}, got {text!r}")
    return values[0] if len(values) == 1 else tuple(values)


def parse_unit_size(text: str) -> int | str:
    """``zeropp``'s scheduling unit: a number of micro-batches >= 1, or ``"auto"``."""
    if str(text).strip().lower() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"expected a number of micro-batches >= 1 or 'auto', got {text!r}") from None
    if value < 1:
        raise ValueError(f"must be >= 1 or 'auto', got {value}")
    return value


_LAYOUT_SYMBOLS = frozenset("EtmL")
_REPEAT_GROUP = re.compile(r"\(([^()]*)\)\*(\d+)")
_REPEAT_ONE = re.compile(r"([EtmL])\*(\d+)")
_MAX_LAYOUT = 100_000  # symbols once expanded: far beyond a real model, small enough to refuse ``(t)*1e9``


def parse_layer_layout(text: str) -> tuple[str, ...]:
    """Megatron's pipeline layout string as one string of layer symbols per stage, in model order.

    ``"Et|(tt|)*2,tL"`` -> ``("Et", "tt", "tt", "tL")``. Only the syntax is checked here (symbols,
    repeats); where ``E`` / ``L`` may go and how many stages there must be depend on the schedule.
    """
    expanded = str(text).replace(",", "").replace(" ", "")
    for pattern in (_REPEAT_GROUP, _REPEAT_ONE):
        while True:
            match = pattern.search(expanded)
            if match is None:
                break
            count = int(match.group(2))
            if len(match.group(1)) * count > _MAX_LAYOUT:
                raise ValueError(f"layout expands to more than {_MAX_LAYOUT} layers: {text!r}")
            expanded = expanded[: match.start()] + match.group(1) * count + expanded[match.end() :]
    stages = tuple(expanded.split("|"))
    bad = sorted({c for stage in stages for c in stage} - _LAYOUT_SYMBOLS)
    if not expanded or bad:
        shown = f" (unknown {''.join(bad)!r})" if bad else ""
        raise ValueError(f"expected {LAYER_LAYOUT_RULE}, got {text!r}{shown}")
    return stages


LAYER_COST_KINDS = ("dense", "moe", "mamba", "attention", "mlp", "moe-mlp", "embedding", "head")
LAYER_COSTS_RULE = (
    "KIND=F,B,W entries separated by ';' (milliseconds of one layer for one micro-batch; KIND one of "
    + ", ".join(LAYER_COST_KINDS)
    + "), optionally micro_batch=N and tp=N"
)


def layer_costs_scale(micro_batch: int, tp: int, measured_micro_batch: int, measured_tp: int) -> float:
    """The factor that takes per-layer times measured at ``measured_micro_batch`` and ``measured_tp`` to a run
    at ``micro_batch`` and ``tp``: linear in the micro-batch, inverse in TP (the GEMMs' share of the work)."""
    return (micro_batch / measured_micro_batch) * (measured_tp / tp)


def parse_layer_costs(text: str) -> tuple[dict[str, tuple[float, float, float]], int, int]:
    """``"dense=1.2,2.3,1.1;head=3,3,2.8;micro_batch=2"`` as ``({kind: (F, B, W)}, micro_batch, tp)``."""
    entries: dict[str, tuple[float, float, float]] = {}
    sizes = {"micro_batch": 1, "tp": 1}
    for cell in (c.strip() for c in str(text).split(";")):
        if not cell:
            continue
        key, sep, value = (x.strip() for x in cell.partition("="))
        key = key.lower()
        if not sep:
            raise ValueError(f"expected {LAYER_COSTS_RULE}, got {cell!r}")
        if key in sizes:
            try:
                sizes[key] = int(value)
            except ValueError:
                raise ValueError(f"{key} must be an integer >= 1, got {value!r}") from None
            if sizes[key] < 1:
                raise ValueError(f"{key} must be an integer >= 1, got {value!r}")
            continue
        if key not in LAYER_COST_KINDS:
            raise ValueError(f"unknown layer kind {key!r}: expected {LAYER_COSTS_RULE}")
        try:
            numbers = [float(x) for x in value.split(",")]
        except ValueError:
            numbers = []
        if len(numbers) != 3 or any(not (math.isfinite(x) and 0 <= x <= MAX_VALUE) for x in numbers):
            raise ValueError(f"{key}: expected F,B,W finite numbers in [0, {MAX_VALUE:g}], got {value!r}")
        entries[key] = (numbers[0], numbers[1], numbers[2])
    if not entries:
        raise ValueError(f"expected {LAYER_COSTS_RULE}, got {text!r}")
    return entries, sizes["micro_batch"], sizes["tp"]
