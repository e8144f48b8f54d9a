"""Emulated expert-parallel all-to-alls for ``megatron-pp bench --emulate --a2a-ms T``: wall time padded on the
communication side, so a 2-core machine shows what a cluster's links cost.

Two ways an all-to-all's pad elapses, matching the simulator's model (:mod:`megatron_pp_ext.analysis.moe_comm`):

* not overlapped: every ``F``, ``B`` and ``BW`` op of a stage with ``L`` MoE layers lasts ``2 L T`` longer
  (its dispatch and combine of every layer, one after the other with its compute): :meth:`A2APads.serial_s`,
  which :class:`~.emulate.PaddedTracer` adds to the op's pad;
* overlapped: a :class:`CommStream` is a virtual communication stream. An all-to-all launched on it starts
  when the stream is free, ends ``T`` later, and costs the caller nothing until it waits for it; the wait
  sleeps until then. So the pad of one side's all-to-all elapses while the caller runs (and pads) the other
  side's compute. :func:`play_pair` runs an overlapped F&B pair node by node this way (compute nodes run
  and padded on the caller's thread, all-to-alls launched on the stream and waited for by the next node of
  their micro-batch), in megatron's combined-1F1B issue order (:func:`~megatron_pp_ext.analysis.moe_comm.pair_nodes`).

The clock and the sleep are injectable: tests run the mechanism on a fake clock, deterministically.
Pure Python (no torch).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..analysis.moe_comm import COMM, Node

__all__ = ["SPIN_S", "A2APads", "CommStream", "play_pair", "sleep_until"]

Clock = Callable[[], float]
Sleep = Callable[[float], None]


#: the last stretch of a pad, seconds, that :func:`sleep_until` spins instead of sleeping
SPIN_S = 0.0003


def sleep_until(deadline: float) -> None:
    """Wait until ``time.perf_counter()`` reaches ``deadline``: sleep (the point is an idle CPU) up to
    :data:`SPIN_S` before it, then spin. A sleep alone wakes ~0.1 ms late on Linux (timer slack and
    wake-up latency), which would make every padded op that much longer than the cost the simulator
    is given, and schedules with more, smaller ops pay it more often; the spin meets the deadline to
    within microseconds for at most 0.3 ms of CPU per op."""
    remaining = deadline - time.perf_counter()
    while remaining > SPIN_S:
        time.sleep(remaining - SPIN_S)
        remaining = deadline - time.perf_counter()
    while time.perf_counter() < deadline:
        pass


def _sleep_until(clock: Clock, sleep: Sleep, deadline: float) -> None:
    remaining = deadline - clock()
    if remaining > 0:
        sleep(remaining)


@dataclass(frozen=True)
class A2APads:
    """``a2a_s``: wall time of one all-to-all (dispatch or combine) of one MoE layer; ``layers``: MoE layers
    of each global stage."""

    a2a_s: float
    layers: tuple[int, ...]

    def serial_s(self, kind: str, stage: int) -> float:
        """What an op that is not overlapped adds to its pad: its layers' all-to-alls one after the other."""
        return 0.0 if kind == "W" else 2 * self.layers[stage] * self.a2a_s


class CommStream:
    """A virtual communication stream: all-to-alls run one after another on it, beside the caller."""

    def __init__(self, clock: Clock = time.perf_counter, sleep: Sleep = time.sleep) -> None:
        self.clock, self.sleep = clock, sleep
        self.free = 0.0
        self.events: list[tuple[str, str, float]] = []  # (what, name, when)

    def launch(self, name: str, duration_s: float) -> float:
        """Start an all-to-all of ``duration_s`` (once the stream is free); returns when it ends."""
        now = self.clock()
        start = max(now, self.free)
        self.free = start + duration_s
        self.events.append(("launch", name, now))
        return self.free

    def wait(self, name: str, done: float) -> None:
        """Block until the all-to-all that ends at ``done`` has ended."""
        _sleep_until(self.clock, self.sleep, done)
        self.events.append(("waited", name, self.clock()))


def play_pair(
    nodes: Sequence[Node],
    stream: CommStream,
    run_compute: Callable[[Node], None] = lambda node: None,
) -> list[tuple[Node, float, float]]:
    """Run an overlapped pair's nodes in issue order: a compute node first waits for its micro-batch's
    pending all-to-all, runs ``run_compute`` and pads to its duration; an all-to-all waits for its
    micro-batch's previous node, then is launched on ``stream`` and not waited for. Returns ``(node, start,
    end)`` per node (an all-to-all: its start and end on the stream)."""
    clock, sleep = stream.clock, stream.sleep
    pending: dict[str, tuple[str, float]] = {}  # side -> its all-to-all in flight (name, end)
    out: list[tuple[Node, float, float]] = []
    for node in nodes:
        name = f"{node.side}.{node.name}"
        if node.side in pending:
            stream.wait(*pending.pop(node.side))
        if node.stream == COMM:
            end = stream.launch(name, node.duration)
            pending[node.side] = (name, end)
            out.append((node, end - node.duration, end))
            continue
        start = clock()
        run_compute(node)
        _sleep_until(clock, sleep, start + node.duration)
        out.append((node, start, clock()))
    for name, end in pending.values():
        stream.wait(name, end)
    return out
