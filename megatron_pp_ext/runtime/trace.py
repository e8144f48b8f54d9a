"""Per-rank instrumentation of the executor: op timings and live activation bytes.

Live activation bytes are measured, not estimated: while a forward op runs, a
``saved_tensors_hooks`` pack hook records the storages autograd saves for the
backward (parameters excluded); they count as live from that F until the
backward op of the same (stage, micro-batch) released them. Weight-gradient
closures held between B and W are added by the weight-gradient store, receive
buffers posted ahead of their consumer (prefetch) by :mod:`.channels` from their
posting until their consumer takes them. Bytes of sends still pending are
measured apart (``peak_pending_send_bytes``): the lowering bounds their number.

The p2p protocol's events (receive posted / waited, send posted / completed, with
the op count at that moment) are kept for the last iteration
(``last_iteration_protocol``), so tests can check the protocol's order from a real run.

Host time between ops is split into named parts, summed over the traced iterations with the number of times
each ran and their median (``host_parts``), so a reader sees what the runtime costs per op: ``p2p posting``
(``begin_comm`` .. ``end_comm``: posting an exchange's transfers, gloo's ``isend`` / ``irecv`` and the code
around them), ``p2p wait`` (the seconds the protocol's events report waited for a receive or a send) and
``bookkeeping``, the rest of the time between ops (the executor's loop, mailbox, receive buffers, plan).
No code of the executor's own is added for it: an untraced run pays nothing.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..schedules.collectives import Collective
from ..schedules.ir import Op


class NullTracer:
    """Does nothing; the executor's default."""

    def bind(self, context: dict[str, Any]) -> None: ...
    def begin_iteration(self, forward_only: bool = False) -> None: ...
    def end_iteration(self) -> None: ...
    def begin_op(self, op: Op) -> None: ...
    def end_op(self, op: Op) -> None: ...
    def begin_comm(self) -> None: ...
    def end_comm(self) -> None: ...
    def released(self, op: Op) -> None: ...
    def collective(self, collective: Collective) -> None: ...
    def add_held_bytes(self, nbytes: int) -> None: ...
    def add_comm_bytes(self, nbytes: int) -> None: ...
    def add_send_bytes(self, nbytes: int) -> None: ...
    def protocol(self, event: str, what: object, **info: Any) -> None: ...

    @contextlib.contextmanager
    def saving(self, op: Op) -> Iterator[None]:
        yield


class Tracer(NullTracer):
    """Records every op's start/end and the live activation bytes after it."""

    def __init__(self, rank: int, param_storages: set[int] | None = None, *, track_memory: bool = True) -> None:
        self.rank = rank
        # False: no saved-tensor hook around forwards (no activation bytes), so op times carry no hook cost
        self.track_memory = track_memory
        self.param_storages = param_storages or set()
        self.events: list[dict[str, Any]] = []  # chrome-trace events
        self.iterations: list[dict[str, Any]] = []
        self._live: dict[tuple[int, int], int] = {}
        self._held = 0
        self._t0 = time.perf_counter()
        self._iter_start = 0.0
        self._busy = 0.0
        self._op_starts: list[float] = []  # a stack: an overlap hook may run an op inside another
        self._first_start: float | None = None
        self._last_end = 0.0
        self.peak_bytes = 0
        self.stage_bytes: dict[int, int] = {}  # bytes one micro-batch's forward saved, per stage
        self._collectives: list[dict[str, Any]] = []  # this iteration's launches
        self._last_backward_end = 0.0
        self._iter_ops: list[list[Any]] = []  # [op, start, end] of this iteration's ops
        self.last_iteration_ops: list[list[Any]] = []
        # bytes held for the whole run (see static_bytes_of); filled by whoever knows the model chunks
        self.static: dict[str, int] = {}
        self._schedule = ""  # the name of the schedule the executor runs (bound per iteration)
        self._comm = 0  # receive buffers posted, not yet taken by their consumer
        self._send_bytes = 0  # bytes of sends still pending
        self._iter_send_peak = 0
        self._ops_done = 0  # ops ended this iteration: the gap a protocol event happens in
        self._iter_protocol: list[dict[str, Any]] = []
        self.last_iteration_protocol: list[dict[str, Any]] = []
        # host time between ops by named part: name -> [seconds, times entered], over every traced iteration
        self.host_parts: dict[str, list[float]] = {}
        self.host_samples: dict[str, list[float]] = {}  # each time a part ran: its seconds (for the median)
        self._ops_total = 0
        self._between_ops = 0.0  # iteration time outside ops, summed over iterations

    def restart(self) -> None:
        """Forget what the iterations so far recorded (op events, per-iteration records, host parts): a warm-up
        iteration, whose first-call costs are not those of a steady run, is then left out of every figure."""
        self.events, self.iterations = [], []
        self.host_parts, self.host_samples = {}, {}
        self._ops_total, self._between_ops = 0, 0.0

    def _add_part(self, name: str, seconds: float) -> None:
        spent = self.host_parts.setdefault(name, [0.0, 0])
        spent[0] += seconds
        spent[1] += 1
        self.host_samples.setdefault(name, []).append(seconds)

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    def live_bytes(self) -> int:
        return sum(self._live.values()) + self._held + self._comm

    def bind(self, context: dict[str, Any]) -> None:
        self._schedule = str(context.get("schedule", ""))

    def begin_iteration(self, forward_only: bool = False) -> None:
        self._iter_start = self._now()
        self._busy = 0.0
        self._first_start = None
        self._iter_peak = self.live_bytes()
        self._collectives = []
        self._last_backward_end = 0.0
        self._iter_ops = []
        self._ops_done = 0
        self._iter_protocol = []
        self._iter_send_peak = self._send_bytes

    def end_iteration(self) -> None:
        end = self._now()
        # every op of the last iteration: [op, start, end] in seconds on the machine's monotonic clock
        # (time.perf_counter: one clock for every process of the machine, so ranks line up)
        self.last_iteration_ops = self._iter_ops
        self.last_iteration_protocol = self._iter_protocol
        span = (self._last_end - self._first_start) if self._first_start is not None else 0.0
        total = end - self._iter_start
        self._ops_total += self._ops_done
        self._between_ops += total - self._busy
        counts: dict[str, int] = {}
        for launch in self._collectives:
            counts[launch["kind"]] = counts.get(launch["kind"], 0) + 1
        self.iterations.append(
            {
                "schedule": self._schedule,  # what the executor ran (a re-plan may switch it)
                "step_time_s": total,
                "busy_s": self._busy,
                "span_s": span,
                "bubble_rate": (total - self._busy) / total if total > 0 else 0.0,
                "peak_activation_bytes": self._iter_peak,
                "peak_pending_send_bytes": self._iter_send_peak,
                "collective_counts": counts,
                # launches relative to the iteration: "before_last_backward_end" says a reduction
                # started while backward work of this rank was still to come (overlap)
                "collectives": [
                    {**launch, "before_last_backward_end": launch["t_s"] < self._last_backward_end - self._iter_start}
                    for launch in self._collectives
                ],
            }
        )

    def collective(self, collective: Collective) -> None:
        now = self._now()
        self._collectives.append(
            {"kind": str(collective.kind), "stage": collective.stage, "t_s": now - self._iter_start}
        )
        self.events.append(
            {
                "name": str(collective),
                "cat": "collective",
                "ph": "i",
                "s": "t",
                "pid": self.rank,
                "tid": 2,
                "ts": now * 1e6,
            }
        )

    def begin_op(self, op: Op) -> None:
        start = self._now()
        self._op_starts.append(start)
        if self._first_start is None:
            self._first_start = start

    def end_op(self, op: Op) -> None:
        end = self._now()
        start = self._op_starts.pop()
        if not self._op_starts:  # busy time of the outermost op (it contains any op run inside it)
            self._busy += end - start
        self._last_end = end
        if op.kind != "F":
            self._last_backward_end = end
        live = self.live_bytes()
        self._ops_done += 1
        self._iter_ops.append([str(op), self._t0 + start, self._t0 + end])
        self._iter_peak = max(self._iter_peak, live)
        self.peak_bytes = max(self.peak_bytes, live)
        self.events.append(
            {
                "name": str(op),
                "cat": op.kind.value,
                "ph": "X",
                "pid": self.rank,
                "tid": 0,
                "ts": start * 1e6,
                "dur": (end - start) * 1e6,
                "args": {"live_activation_bytes": live},
            }
        )

    def begin_comm(self) -> None:
        self._comm_start = self._now()

    def end_comm(self) -> None:
        end = self._now()
        self._add_part("p2p posting", end - self._comm_start)
        self.events.append(
            {
                "name": "p2p",
                "cat": "comm",
                "ph": "X",
                "pid": self.rank,
                "tid": 1,
                "ts": self._comm_start * 1e6,
                "dur": (end - self._comm_start) * 1e6,
            }
        )

    def add_held_bytes(self, nbytes: int) -> None:
        # Counted at the next op boundary: during the B op the held inputs are still counted among
        # the saved tensors (same storages), so sampling here would count them twice.
        self._held += nbytes

    def add_comm_bytes(self, nbytes: int) -> None:
        self._comm += nbytes

    def add_send_bytes(self, nbytes: int) -> None:
        self._send_bytes += nbytes
        self._iter_send_peak = max(self._iter_send_peak, self._send_bytes)

    def protocol(self, event: str, what: object, **info: Any) -> None:
        """One p2p protocol event (``recv-post``, ``recv-wait``, ``send-post``, ``send-done``) of
        message ``what`` (recorded as ``str(what)``), at gap ``gap`` (ops ended so far this iteration)."""
        event_record = {"event": event, "what": str(what), "gap": self._ops_done, "t": self._now(), **info}
        waited = info.get("waited_s")
        if waited is not None:
            self._add_part("p2p wait", waited)
        self._iter_protocol.append(event_record)

    def released(self, op: Op) -> None:
        self._live.pop((op.stage, op.microbatch), None)

    @contextlib.contextmanager
    def saving(self, op: Op) -> Iterator[None]:
        if not self.track_memory:
            yield
            return
        seen: set[int] = set()
        total = 0

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            nonlocal total
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key not in seen and key not in self.param_storages and storage.nbytes() > 0:
                seen.add(key)
                total += storage.nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield
        self._live[(op.stage, op.microbatch)] = total
        self.stage_bytes[op.stage] = total

    def op_times(self) -> dict[str, dict[int, float]]:
        """Mean duration (s) of each op kind per stage, over every traced op."""
        sums: dict[tuple[str, int], list[float]] = {}
        for event in self.events:
            if event["cat"] in ("comm", "collective"):
                continue
            kind, stage = event["cat"], int(event["name"][len(event["cat"]) :].split(".")[0])
            sums.setdefault((kind, stage), []).append(event["dur"] / 1e6)
        out: dict[str, dict[int, float]] = {}
        for (kind, stage), values in sums.items():
            out.setdefault(kind, {})[stage] = sum(values) / len(values)
        return out

    def summary(self) -> dict[str, Any]:
        last = self.iterations[-1] if self.iterations else {}
        return {
            "op_times_s": self.op_times(),
            "stage_activation_bytes": dict(self.stage_bytes),
            "rank": self.rank,
            "iterations": len(self.iterations),
            "measured_bubble_rate": last.get("bubble_rate"),
            "peak_activation_bytes": self.peak_bytes,
            "static_bytes": dict(self.static),
            # the rank's memory as the planner's memory model counts it: what is held for the whole run plus
            # the peak of live activations (None without static_bytes)
            "peak_bytes": (sum(self.static.values()) + self.peak_bytes) if self.static else None,
            "per_iteration": self.iterations,
            "last_iteration_ops": self.last_iteration_ops,
            "last_iteration_protocol": self.last_iteration_protocol,
            "host_parts": self.host_split(),
        }

    def host_split(self) -> dict[str, Any]:
        """Where the time between ops went, over every traced iteration: each named part's seconds and count,
        ``bookkeeping`` (the rest of the time between ops: the executor's own loop, mailbox, plan lookups), the
        number of ops and the seconds per op of each. A part's median is its cost without the waits some of its
        runs hold (posting waits when the number of pending sends reaches its bound)."""
        parts: dict[str, dict[str, Any]] = {
            name: {"s": s, "count": int(n), "median_s": statistics.median(self.host_samples[name])}
            for name, (s, n) in self.host_parts.items()
        }
        named = sum(s for s, _ in self.host_parts.values())
        parts["bookkeeping"] = {"s": max(self._between_ops - named, 0.0), "count": self._ops_total}
        ops = max(self._ops_total, 1)
        return {"ops": self._ops_total, "parts": parts, "per_op_s": {k: v["s"] / ops for k, v in parts.items()}}

    def write(self, directory: str | Path) -> None:
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"trace_rank{self.rank}.json").write_text(json.dumps({"traceEvents": self.events}))
        (out / f"summary_rank{self.rank}.json").write_text(json.dumps(self.summary(), indent=1))


def static_bytes_of(chunks: Any, optimizer_bytes_per_parameter: float = 8.0) -> dict[str, int]:
    """Bytes a rank holds for the whole run for its model ``chunks``: parameters and gradient buffers as
    allocated (megatron DDP's ``main_grad``, else ``grad``, else one per parameter of its size), and the
    optimizer state by accounting (default: Adam's two fp32 moments per parameter, allocated by its first
    step, outside the traced iterations)."""
    params: dict[int, torch.Tensor] = {}
    for chunk in chunks if isinstance(chunks, list | tuple) else [chunks]:
        for param in chunk.parameters():
            params.setdefault(id(param), param)
    weight = grad = numel = 0
    for param in params.values():
        numel += param.numel()
        weight += param.numel() * param.element_size()
        buffer = getattr(param, "main_grad", None)
        if buffer is None:
            buffer = param.grad
        grad += buffer.numel() * buffer.element_size() if buffer is not None else param.numel() * param.element_size()
    return {
        "parameters": weight,
        "gradients": grad,
        "optimizer_accounted": int(numel * optimizer_bytes_per_parameter),
    }
