"""MoE expert-parallel all-to-alls in the simulator: serial per op, or hidden inside an overlapped F&B pair.

A MoE layer's forward is four nodes, as megatron-core's schedule plan splits it: attention (compute),
dispatch all-to-all (communication), experts (compute), combine all-to-all (communication); its
backward runs them in reverse (combine backward, experts backward, dispatch backward, attention
backward). Model, per stage with ``L`` MoE layers, compute time ``C`` of the op (``t_f``, ``t_b`` or
``t_bw`` of :class:`~megatron_pp_ext.schedules.costs.Costs`) and ``a`` the time of one all-to-all:

* each layer's compute is ``C / L``, half attention and half experts (``C / 2L`` each node);
* an op that is not overlapped pays its all-to-alls one after the other: ``C + 2 L a`` for ``F``,
  ``B`` and ``BW`` (``W`` has none);
* an overlapped pair (``Schedule.overlap_pairs``, one forward and one backward) runs on two streams,
  compute and communication, in megatron's combined-1F1B issue order per layer pair (forward layer
  ``i`` with backward layer ``L_b - 1 - i``): combine-backward, attention-forward, experts-backward,
  dispatch-forward, dispatch-backward, experts-forward, combine-forward, attention-backward. A node
  starts when its stream is free and the previous node of its own micro-batch has ended, so each
  side's all-to-all runs under the other side's compute. A stage with no MoE layer counts as one layer
  whose all-to-alls take no time; where the two sides have different layer counts, the extra layers
  of one side run alone after the paired ones.

Where the all-to-alls are launched: on GPU (``host_launch=False``, default) the host issues every node
ahead and the streams alone order them, as above; on CPU (``host_launch=True``: the executor under gloo,
the emulated bench) the compute runs on the host thread, so an all-to-all is launched only once the host
has finished the compute issued before it, and starts no earlier than that.

With ``a = 0`` a pair takes ``C_f + C_b`` (both on the compute stream): the old model without overlap.
A pair never takes longer than its two ops one after the other (every node starts no later than the
end of the node issued before it). A pair's outputs do not wait for its end: the forward's leaves when
the forward's last node has ended, the backward's when the backward's has (:func:`pair_step`), as the
executor posts the forward's send from inside megatron's combined step.

Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ..schedules.costs import expand_cost
from ..schedules.ir import Op, OpKind

__all__ = ["MoeComm", "Node", "pair_nodes", "pair_step", "pair_time", "serial_time", "timed_nodes"]

COMPUTE, COMM = "compute", "comm"
FORWARD, BACKWARD = "F", "B"


@dataclass(frozen=True)
class MoeComm:
    """The all-to-all model's input: ``a2a`` the time of one all-to-all (dispatch or combine) of one MoE
    layer, in the costs' unit; ``layers`` MoE layers of each global stage (one number or one per stage);
    ``overlap``: the schedule's overlap pairs run as two streams (megatron's
    ``--overlap-moe-expert-parallel-comm``), else every all-to-all adds to its op; ``host_launch``: the
    CPU launch model (module doc)."""

    a2a: float
    layers: int | tuple[int, ...]
    overlap: bool = False
    host_launch: bool = False  # all-to-alls launched by the host after the compute before them (CPU)

    def __post_init__(self) -> None:
        if isinstance(self.a2a, bool) or not isinstance(self.a2a, int | float) or not 0 <= self.a2a < float("inf"):
            raise ValueError(f"a2a (time of one all-to-all) must be a finite number >= 0, got {self.a2a!r}")
        values = self.layers if isinstance(self.layers, tuple) else (self.layers,)
        if not values or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in values):
            raise ValueError(f"layers (MoE layers per stage) must be integers >= 0, got {self.layers!r}")

    def per_stage(self, num_stages: int) -> list[int]:
        """MoE layers of every global stage."""
        layers = self.layers if isinstance(self.layers, tuple) else float(self.layers)
        return [int(x) for x in expand_cost("moe layers", layers, num_stages)]


class Node(NamedTuple):
    """One node of a pair: its micro-batch side (``F`` / ``B``), stream, what it is and its duration."""

    side: str
    stream: str
    name: str
    duration: float


def serial_time(kind: OpKind, compute: float, layers: int, a2a: float) -> float:
    """An op that is not overlapped: its compute plus its layers' all-to-alls one after the other."""
    return compute if kind is OpKind.W else compute + 2 * layers * a2a


def _side(side: str, compute: float, layers: int, a2a: float) -> list[list[Node]]:
    """One side's nodes, grouped per MoE layer in its own execution order (a stage without MoE layers:
    one layer whose all-to-alls take no time, as megatron's plan runs a dense layer)."""
    if layers == 0:
        layers, a2a = 1, 0.0
    half = compute / (2 * layers)
    if side == FORWARD:
        names = (("attn", COMPUTE, half), ("dispatch", COMM, a2a), ("experts", COMPUTE, half), ("combine", COMM, a2a))
    else:
        names = (("combine", COMM, a2a), ("experts", COMPUTE, half), ("dispatch", COMM, a2a), ("attn", COMPUTE, half))
    return [[Node(side, stream, name, d) for name, stream, d in names] for _ in range(layers)]


# megatron's combined-1F1B issue order within one layer pair: (side, index of the node in its layer)
_ISSUE = (
    (BACKWARD, 0),
    (FORWARD, 0),
    (BACKWARD, 1),
    (FORWARD, 1),
    (BACKWARD, 2),
    (FORWARD, 2),
    (FORWARD, 3),
    (BACKWARD, 3),
)


def pair_nodes(f_compute: float, f_layers: int, b_compute: float, b_layers: int, a2a: float) -> list[Node]:
    """The nodes of an overlapped pair in issue order (module doc)."""
    fwd = _side(FORWARD, f_compute, f_layers, a2a)
    bwd = _side(BACKWARD, b_compute, b_layers, a2a)
    out: list[Node] = []
    for i in range(max(len(fwd), len(bwd))):
        f = fwd[i] if i < len(fwd) else None
        b = bwd[i] if i < len(bwd) else None
        if f is not None and b is not None:
            out.extend((f if side == FORWARD else b)[k] for side, k in _ISSUE)
        else:
            out.extend(b or ())
            out.extend(f or ())
    return out


def timed_nodes(nodes: Sequence[Node], host_launch: bool = False) -> list[tuple[Node, float, float]]:
    """``(node, start, end)`` of each node on two streams: a node starts when its stream is free and the
    previous node of its side has ended (``host_launch``: an all-to-all also waits for the compute issued
    before it)."""
    stream_free = {COMPUTE: 0.0, COMM: 0.0}
    side_done = {FORWARD: 0.0, BACKWARD: 0.0}
    out = []
    for node in nodes:
        start = max(stream_free[node.stream], side_done[node.side])
        if host_launch and node.stream == COMM:
            start = max(start, stream_free[COMPUTE])
        end = start + node.duration
        stream_free[node.stream] = side_done[node.side] = end
        out.append((node, start, end))
    return out


def pair_time(
    f_compute: float, f_layers: int, b_compute: float, b_layers: int, a2a: float, host_launch: bool = False
) -> float:
    """Duration of an overlapped F&B pair: the end of its last node."""
    return pair_step(f_compute, f_layers, b_compute, b_layers, a2a, host_launch)[0]


def pair_step(
    f_compute: float, f_layers: int, b_compute: float, b_layers: int, a2a: float, host_launch: bool = False
) -> tuple[float, float, float]:
    """``(duration, forward out, backward out)`` of an overlapped F&B pair, from its start: the end of its
    last node, and when each side's output leaves. The forward's output is sent from inside the step
    (megatron's ``post_forward``) once the forward's last node has ended; on the CPU launch model the host
    calls it only after the compute it issued before (every compute node of the pair). The backward's
    input gradient leaves when its last node ends."""
    timed = timed_nodes(pair_nodes(f_compute, f_layers, b_compute, b_layers, a2a), host_launch)
    end = {FORWARD: 0.0, BACKWARD: 0.0, COMPUTE: 0.0}
    for node, _, stop in timed:
        end[node.side] = max(end[node.side], stop)
        if node.stream == COMPUTE:
            end[COMPUTE] = max(end[COMPUTE], stop)
    f_out = max(end[FORWARD], end[COMPUTE]) if host_launch else end[FORWARD]
    return max(end[FORWARD], end[BACKWARD]), f_out, end[BACKWARD]


def op_times(
    ops: Sequence[Op], compute: Sequence[float], pairs: Sequence[int], layers: Sequence[int], moe: MoeComm
) -> tuple[list[float], dict[int, float], dict[int, tuple[float, float]]]:
    """One rank's op durations with the all-to-alls, the duration of each overlapped pair (by the
    index of its first op; empty without ``moe.overlap``) and when, from the pair's start, the outputs
    of its first and second op leave (:func:`pair_step`). A pair that is not one forward and one
    backward (``B`` or ``BW``) hides nothing: its two ops one after the other, both sent at its end."""
    serial = [serial_time(op.kind, c, layers[op.stage], moe.a2a) for op, c in zip(ops, compute, strict=True)]
    steps: dict[int, float] = {}
    sends: dict[int, tuple[float, float]] = {}
    if not moe.overlap:
        return serial, steps, sends
    for i in pairs:
        f, bwd = (i, i + 1) if ops[i].kind is OpKind.F else (i + 1, i)
        if ops[f].kind is not OpKind.F or ops[bwd].kind not in (OpKind.B, OpKind.BW):
            steps[i] = serial[i] + serial[i + 1]
            sends[i] = (steps[i], steps[i])
            continue
        lf, lb = layers[ops[f].stage], layers[ops[bwd].stage]
        steps[i], f_out, b_out = pair_step(compute[f], lf, compute[bwd], lb, moe.a2a, moe.host_launch)
        sends[i] = (f_out, b_out) if f == i else (b_out, f_out)
    return serial, steps, sends
