"""Profile-guided re-planning: start from default costs, measure, agree, rebuild once.

A cost-aware schedule (``zb-auto``, ``v-zb`` with costs) is first built with
default costs. During the first ``profile_iterations`` training iterations a
:class:`ProfilingTracer` times every F, B, W and BW op on every rank; then all
ranks, at the same point of the same iteration,

1. measure the one-hop p2p time of one activation with a neighbour ping-pong,
2. agree on one profile: each stage's median op times from the rank that owns it
   (an all-reduce over the pipeline group), averaged over the pipelines of the
   world (data/tensor parallel replicas),
3. rebuild and validate the schedule with those costs; the executor picks it up
   on the next call.

Only the order of ops changes, so the training math does not (the verify
harness checks loss and gradients at every iteration across the switch). The
profile is logged and can be written to a JSON file and passed back later
(``--pipeline-costs FILE``) to skip the profiling.

Test hook (never set it in a real run): ``MEGATRON_PP_TEST_SCALE_MEASURED`` (e.g. ``b=4`` or ``w=0.5,b=4``)
multiplies the agreed profile's F, B or W times before the rebuild, so a test can make a measured profile
favour a chosen kind of schedule deterministically (``--pipeline-schedule auto --pipeline-replan``'s switch).
The scaled profile is what is logged and written, and a warning line says it was scaled.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..analysis.simulate import Costs
from ..schedules.ir import Op, OpKind
from ..schedules.kind_profile import kind_times, layer_costs_text, stage_kind_counts
from ..schedules.layer_split import LayerSplit, LayerSplitError
from ..schedules.placement import Placement
from ..schedules.schedule import Schedule
from . import p2p
from .trace import NullTracer

logger = logging.getLogger(__name__)

BuildSchedule = Callable[[int, Costs | None], Schedule]


def _now() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


class ProfilingTracer(NullTracer):
    """Times compute ops of training iterations; forwards every event to ``inner``."""

    def __init__(self, inner: NullTracer, on_iteration: Callable[[ProfilingTracer], None]) -> None:
        self.inner = inner
        self.on_iteration = on_iteration
        self.durations: dict[tuple[OpKind, int], list[float]] = defaultdict(list)
        self.training_iterations = 0
        self.active = True
        self._forward_only = False
        self._start = 0.0
        self.run_context: dict[str, Any] = {}

    def bind(self, context: dict[str, Any]) -> None:
        self.run_context = context
        self.inner.bind(context)

    def begin_iteration(self, forward_only: bool = False) -> None:
        self._forward_only = forward_only
        self.inner.begin_iteration(forward_only)

    def end_iteration(self) -> None:
        self.inner.end_iteration()
        if not self._forward_only and self.active:
            self.training_iterations += 1
            self.on_iteration(self)

    def begin_op(self, op: Op) -> None:
        self.inner.begin_op(op)
        if self.active and not self._forward_only:
            self._start = _now()

    def end_op(self, op: Op) -> None:
        if self.active and not self._forward_only:
            self.durations[(op.kind, op.stage)].append(_now() - self._start)
        self.inner.end_op(op)

    def begin_comm(self) -> None:
        self.inner.begin_comm()

    def end_comm(self) -> None:
        self.inner.end_comm()

    def released(self, op: Op) -> None:
        self.inner.released(op)

    def add_held_bytes(self, nbytes: int) -> None:
        self.inner.add_held_bytes(nbytes)

    def add_comm_bytes(self, nbytes: int) -> None:
        self.inner.add_comm_bytes(nbytes)

    def add_send_bytes(self, nbytes: int) -> None:
        self.inner.add_send_bytes(nbytes)

    def protocol(self, event: str, what: object, **info: Any) -> None:
        self.inner.protocol(event, what, **info)

    @contextmanager
    def saving(self, op: Op) -> Iterator[None]:
        with self.inner.saving(op):
            yield

    def write(self, directory: str | Path) -> None:
        if hasattr(self.inner, "write"):
            self.inner.write(directory)


def _all_reduce(table: torch.Tensor, group: dist.ProcessGroup | None, op: Any, timeout_s: float, what: str) -> None:
    """``all_reduce`` with a bounded wait (a rank that never joins fails this one, naming ``what``)."""
    work = dist.all_reduce(table, op=op, group=group, async_op=True)
    assert work is not None
    try:
        work.wait(datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise p2p.PipelineCommError(
            f"rank {dist.get_rank()}: re-plan: {what} did not complete within {timeout_s:g}s "
            f"({p2p.TIMEOUT_ENV}): {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}"
        ) from exc


def measure_hop_time(
    group: dist.ProcessGroup,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: Any,
    repeats: int = 5,
    timeout_s: float | None = None,
) -> float:
    """One-way time of one activation between pipeline neighbours (median of ping-pongs, max over pairs).

    Every send and receive is waited on for at most ``timeout_s`` (None: ``MEGATRON_PP_P2P_TIMEOUT``).
    """
    timeout_s = p2p.timeout_from_env() if timeout_s is None else timeout_s
    rank, size = group.rank(), group.size()
    ranks = [dist.get_global_rank(group, r) for r in range(size)]
    buf = torch.zeros(shape, dtype=dtype, device=device)
    mine: list[float] = []
    where = f"pipeline rank {rank} (global {dist.get_rank()}), re-plan hop-time ping-pong"
    for phase in (0, 1):  # pairs (0,1),(2,3),... then (1,2),(3,4),...
        first = rank - ((rank - phase) % 2)
        if first < phase or first + 1 >= size:
            continue
        peer = first + 1 if rank == first else first
        transfer = p2p.Transfer(buf, ranks[peer], 0, "hop-time probe")
        order = ("send", "recv") if rank == first else ("recv", "send")
        for _ in range(repeats):
            start = _now()
            for direction in order:
                sends, recvs = ([transfer], []) if direction == "send" else ([], [transfer])
                p2p.post(sends, recvs, group, rank_desc=where, timeout_s=timeout_s).wait()
            mine.append((_now() - start) / 2)
    hop = torch.tensor([statistics.median(mine) if mine else 0.0], dtype=torch.float64)
    _all_reduce(hop, group, dist.ReduceOp.MAX, timeout_s, "the hop-time all-reduce")
    return float(hop.item())


def agree_on_costs(
    durations: dict[tuple[OpKind, int], list[float]], num_stages: int, group: dist.ProcessGroup, hop_time: float
) -> Costs:
    """One profile for every rank: each stage's median times from its owner, averaged over pipelines."""
    kinds = (OpKind.F, OpKind.B, OpKind.W, OpKind.BW)
    table = torch.zeros(len(kinds), num_stages, dtype=torch.float64)
    for (kind, stage), values in durations.items():
        table[kinds.index(kind), stage] = statistics.median(values)
    timeout_s = p2p.timeout_from_env()
    _all_reduce(table, group, dist.ReduceOp.SUM, timeout_s, "the cost-profile all-reduce")
    if dist.get_world_size() > group.size():  # average the pipelines of the world
        _all_reduce(table, None, dist.ReduceOp.SUM, timeout_s, "the cost-profile all-reduce over pipelines")
        table /= dist.get_world_size() // group.size()
    t_f, t_b, t_w, t_bw = (tuple(float(x) for x in row) for row in table)
    if all(x == 0.0 for x in t_b):  # the first schedule never split the backward: split BW evenly
        t_b = tuple(x / 2 for x in t_bw)
        t_w = tuple(x / 2 for x in t_bw)
    return Costs(t_f=t_f, t_b=t_b, t_w=t_w, t_comm=hop_time)


TEST_SCALE_ENV = "MEGATRON_PP_TEST_SCALE_MEASURED"


def parse_test_scale(text: str) -> dict[str, float]:
    """``KIND=FACTOR[,KIND=FACTOR...]`` (KIND f, b or w; FACTOR finite > 0); ValueError naming the variable."""
    scale: dict[str, float] = {}
    for cell in (c.strip() for c in text.split(",") if c.strip()):
        kind, sep, value = cell.partition("=")
        try:
            factor = float(value)
        except ValueError:
            factor = math.nan
        if not sep or kind.strip().lower() not in ("f", "b", "w") or not math.isfinite(factor) or factor <= 0:
            raise ValueError(
                f"{TEST_SCALE_ENV} (test-only): expected KIND=FACTOR[,KIND=FACTOR...] with KIND f, b or w and "
                f"FACTOR a finite number > 0, got {text!r}"
            )
        scale[kind.strip().lower()] = factor
    return scale


def scaled_for_test(costs: Costs, scale: dict[str, float]) -> Costs:
    """``costs`` with its F, B and W times multiplied by ``scale``'s factors (the test hook above)."""

    def times(value: Any, factor: float) -> Any:
        return tuple(x * factor for x in value) if isinstance(value, tuple) else value * factor

    fields = {f"t_{kind}": times(getattr(costs, f"t_{kind}"), factor) for kind, factor in scale.items()}
    return replace(costs, **fields)  # t_bw: None (B + W) as agree_on_costs gives it


def costs_to_json(costs: Costs) -> dict[str, Any]:
    return {"t_f": costs.t_f, "t_b": costs.t_b, "t_w": costs.t_w, "t_comm": costs.t_comm}


# A profile file's optional per-layer-kind entries: the text ``--pipeline-costs`` and ``plan --layer-costs`` take
# (``KIND=F,B,W;...;micro_batch=N;tp=N``). The writer measures per-stage times (one op runs a stage's layers back
# to back) and adds them where the stages' layers determine them (:class:`ProfileLayers`); else a user may.
LAYER_COSTS_KEY = "layer_costs"


def load_profile(path: str | Path) -> tuple[Costs, str | None]:
    """A profile file's per-stage costs and its per-layer-kind text (``None`` without one), unchecked."""
    data = json.loads(Path(path).read_text())
    as_tuple = lambda v: tuple(v) if isinstance(v, list) else v  # noqa: E731
    f, b, w = (as_tuple(data[key]) for key in ("t_f", "t_b", "t_w"))
    costs = Costs(t_f=f, t_b=b, t_w=w, t_comm=data["t_comm"])
    layers = data.get(LAYER_COSTS_KEY)
    if layers is not None and not isinstance(layers, str):
        raise ValueError(f"{LAYER_COSTS_KEY!r} must be text like 'dense=1.2,2.3,1.1;head=3,3,2.8', got {layers!r}")
    return costs, layers


def load_costs(path: str | Path) -> Costs:
    return load_profile(path)[0]


@dataclass(frozen=True)
class ProfileLayers:
    """The run's decoder layers by kind (model order), its split, micro-batch size and TP: what a written
    profile needs to carry per-layer-kind entries (:mod:`megatron_pp_ext.schedules.kind_profile`)."""

    kinds: tuple[str, ...]
    split: LayerSplit | None
    micro_batch: int
    tp: int

    def text(self, costs: Costs, placement: Placement) -> str | None:
        """The ``KIND=F,B,W;...`` text the measured per-stage ``costs`` determine, or None where they do not."""
        try:
            counts = stage_kind_counts(self.kinds, placement, self.split)
        except LayerSplitError:
            return None
        f, b, w, _ = costs.per_stage(placement.num_stages)
        times = kind_times(counts, list(zip(f, b, w, strict=True)))
        return None if times is None else layer_costs_text(times, self.micro_batch, self.tp)


class ReplanningSource:
    """``schedule_for(m)`` that re-plans once from costs measured on the running job."""

    def __init__(
        self,
        build: BuildSchedule,
        profile_iterations: int,
        *,
        profile_out: str | Path | None = None,
        log: Callable[[str], None] | None = None,
        profile_layers: ProfileLayers | None = None,
    ) -> None:
        if profile_iterations < 1:
            raise ValueError(f"profile_iterations must be >= 1, got {profile_iterations}")
        self.build = build
        self.profile_iterations = profile_iterations
        self.profile_out = profile_out
        self.profile_layers = profile_layers
        self.log = log or logger.info
        self.costs: Costs | None = None
        self.replanned = False
        self._cache: dict[tuple[int, bool], Schedule] = {}

    def __call__(self, num_microbatches: int) -> Schedule:
        key = (num_microbatches, self.replanned)
        if key not in self._cache:
            self._cache[key] = self.build(num_microbatches, self.costs)
        return self._cache[key]

    def make_tracer(self, inner: NullTracer | None = None) -> ProfilingTracer:
        """A tracer (wrapping ``inner``) that triggers the re-plan after the profiling iterations."""
        return ProfilingTracer(inner or NullTracer(), self._after_iteration)

    def _after_iteration(self, tracer: ProfilingTracer) -> None:
        if tracer.training_iterations < self.profile_iterations or self.replanned:
            return
        tracer.active = False
        ctx = tracer.run_context
        pp_group = ctx["pp_group"]
        hop = measure_hop_time(pp_group, ctx["tensor_shape"], ctx["dtype"], ctx["device"])
        self.costs = agree_on_costs(tracer.durations, ctx["num_stages"], pp_group, hop)
        scale_text = os.environ.get(TEST_SCALE_ENV)
        if scale_text:  # test-only: see the module docstring
            scale = parse_test_scale(scale_text)
            self.costs = scaled_for_test(self.costs, scale)
            self.log(f"megatron_pp_ext: WARNING: {TEST_SCALE_ENV}={scale_text} scaled the measured profile (test hook)")
        self.replanned = True
        schedule = self(ctx["num_microbatches"])
        self.log(
            f"megatron_pp_ext: re-planned {schedule.name!r} from a profile of {tracer.training_iterations} "
            f"iteration(s): {json.dumps(costs_to_json(self.costs))}\n{schedule.table(max_ops=24)}"
        )
        if self.profile_out and dist.get_rank() == 0:
            doc = costs_to_json(self.costs)
            layers = self.profile_layers.text(self.costs, schedule.placement) if self.profile_layers else None
            if layers is not None:
                doc[LAYER_COSTS_KEY] = layers
            Path(self.profile_out).write_text(json.dumps(doc, indent=1))
