"""Re-timing one lowered schedule under many cost vectors, fast.

The planner simulates the same lowered schedule with thousands of different per-stage costs
(every micro-batch size, TP size and recompute choice changes them). The timing rules are those of
:func:`megatron_pp_ext.analysis.simulate.simulate`, in either of its communication models: an op
starts when its rank is free; an exchange posts its sends at once (a message sent at ``t`` arrives
at ``t + t_comm``); with ``comm="async"`` a compute op also waits for its own input message only,
with ``comm="blocking"`` the exchange ends when every receive it holds has arrived. What depends on
the costs is only which predecessor is the latest, so the program is compiled once into a graph
whose nodes are the compute ops (blocking: an exchange's receives are merged into the op that
follows it; a send is posted when the node before its exchange ends), put in a topological order,
and each cost vector is one linear pass over it. ``tests/planner`` checks the result against
``simulate`` for every registered schedule, in both models.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from ..schedules.costs import Costs
from ..schedules.ir import OpKind
from ..schedules.lowering import Compute, LoweredSchedule

__all__ = ["ProgramTiming", "TimingProgram"]

_CODE = {OpKind.F: 0, OpKind.B: 1, OpKind.W: 2, OpKind.BW: 3}


@dataclass(frozen=True)
class ProgramTiming:
    makespan: float
    busy: list[float]
    span: list[float]


class TimingProgram:
    """The lowered schedule compiled for repeated timing (see the module doc)."""

    def __init__(
        self, lowered: LoweredSchedule, comm: str = "async", starts: Sequence[Sequence[float]] | None = None
    ) -> None:
        """``starts``: optional per-rank op start times of one simulation of this schedule with
        positive durations (``SimResult.starts``); in the async model they give a topological
        order directly (checked; Kahn's algorithm otherwise).
        Long because it builds the program's flat arrays in one pass over the ops, the form the retiming loop reads.
        """
        if comm not in ("async", "blocking"):
            raise ValueError(f"comm must be async or blocking, got {comm!r}")
        blocking = comm == "blocking"
        schedule = lowered.schedule
        stages = schedule.num_stages
        self.num_stages = stages
        p = schedule.num_ranks
        m = schedule.num_microbatches
        kind_f, kind_b, kind_w = OpKind.F, OpKind.B, OpKind.W
        # node: (prev node or -1, duration index or -1 for a pure wait, received message ids);
        # message id = ((dst_stage * m + microbatch) << 1) | is_gradient
        nodes: list[tuple[int, int, tuple[int, ...]]] = []
        append = nodes.append
        post_node: dict[int, int] = {}  # message -> node whose end is its send time
        self.first_compute = [-1] * p
        self.last_compute = [-1] * p
        self.counts = [[[0] * stages for _ in range(4)] for _ in range(p)]
        for rank, program in enumerate(lowered.programs):
            prev = -1
            pending: list[int] = []
            posted: set[int] = set()  # async: messages this rank receives
            counts = self.counts[rank]
            first = last = -1
            for ins in program:
                if type(ins) is Compute:
                    op = ins.op
                    kind = op.kind
                    stage = op.stage
                    code = 0 if kind is kind_f else 1 if kind is kind_b else 2 if kind is kind_w else 3
                    n = len(nodes)
                    if blocking:
                        waits = tuple(pending)
                        pending = []
                    else:  # its own input only (W's key is its B's input: already arrived)
                        mid = ((stage * m + op.microbatch) << 1) | (code != 0)
                        waits = (mid,) if mid in posted else ()
                    append((prev, code * stages + stage, waits))
                    counts[code][stage] += 1
                    if first < 0:
                        first = n
                    last = prev = n
                    continue
                if ins.sends:
                    if pending:  # an earlier exchange's receives delay these sends: make them a node
                        append((prev, -1, tuple(pending)))
                        pending = []
                        prev = len(nodes) - 1
                    for msg in ins.sends:
                        post_node[((msg.dst_stage * m + msg.microbatch) << 1) | (msg.kind == "grad")] = prev
                if ins.recvs:
                    ids = [((x.dst_stage * m + x.microbatch) << 1) | (x.kind == "grad") for x in ins.recvs]
                    if blocking:
                        pending.extend(ids)
                    else:
                        posted.update(ids)
            self.first_compute[rank] = first
            self.last_compute[rank] = last
            if pending:
                append((prev, -1, tuple(pending)))
        none = len(nodes)  # a sentinel node whose end stays 0.0
        resolved: list[tuple[int, int, tuple[int, ...]]] = []
        for prev, di, keys in nodes:
            try:
                srcs = tuple(post_node[k] for k in keys)
            except KeyError:
                raise ValueError("lowered schedule receives a message nobody sends") from None
            if -1 in srcs:
                srcs = tuple(none if x < 0 else x for x in srcs)
            resolved.append((none if prev < 0 else prev, di, srcs))
        order = self._order_from_starts(resolved, starts) if (starts is not None and not blocking) else None
        if order is None:
            order = _kahn(resolved, none)
        self.order = [(n, *resolved[n]) for n in order]
        self.num_nodes = none
        self.first_prev = [resolved[n][0] if n >= 0 else none for n in self.first_compute]
        self.first_srcs = [resolved[n][2] if n >= 0 else () for n in self.first_compute]

    @staticmethod
    def _order_from_starts(
        resolved: Sequence[tuple[int, int, tuple[int, ...]]], starts: Sequence[Sequence[float]]
    ) -> list[int] | None:
        """Nodes (all compute ops, in rank-major program order) sorted by a simulation's start
        times, if that is a topological order (every predecessor earlier), else ``None``."""
        flat = [t for row in starts for t in row]
        if len(flat) != len(resolved):
            return None
        order = sorted(range(len(flat)), key=flat.__getitem__)
        none = len(resolved)
        position = [0] * (none + 1)
        position[none] = -1
        for i, n in enumerate(order):
            position[n] = i
        for n, (prev, _di, srcs) in enumerate(resolved):
            here = position[n]
            if position[prev] >= here or any(position[src] >= here for src in srcs):
                return None
        return order

    def run(self, costs: Costs) -> ProgramTiming:
        f, b, w, bw = costs.per_stage(self.num_stages)
        return self.run_tables((f, b, w, bw), float(costs.t_comm))

    def run_tables(self, tables: Sequence[Sequence[float]], comm: float) -> ProgramTiming:
        """``tables`` = per-stage ``(t_f, t_b, t_w, t_bw)``; ``comm`` = one hop."""
        flat = [x for table in tables for x in table]
        end = [0.0] * (self.num_nodes + 1)
        for n, prev, di, srcs in self.order:
            t = end[prev]
            for src in srcs:
                x = end[src] + comm
                if x > t:
                    t = x
            end[n] = t + flat[di] if di >= 0 else t
        busy = []
        for rank_counts in self.counts:
            total = 0.0
            for code in range(4):
                row, table = rank_counts[code], tables[code]
                total += sum(c * table[st] for st, c in enumerate(row) if c)
            busy.append(total)
        span = []
        for last, fp, fs in zip(self.last_compute, self.first_prev, self.first_srcs, strict=True):
            if last < 0:
                span.append(0.0)
                continue
            start = max([end[fp], *(end[s] + comm for s in fs)])
            span.append(end[last] - start)
        makespan = max((end[last] for last in self.last_compute if last >= 0), default=0.0)
        return ProgramTiming(makespan, busy, span)


def _kahn(resolved: Sequence[tuple[int, int, tuple[int, ...]]], none: int) -> list[int]:
    """A topological order of the nodes (program-order and message edges; ``none`` = sentinel)."""
    succ: list[list[int]] = [[] for _ in range(none + 1)]
    indeg = [0] * (none + 1)
    for n, (prev, _di, srcs) in enumerate(resolved):
        for src in (prev, *srcs):
            succ[src].append(n)
            indeg[n] += 1
    queue = deque([none])
    order = []
    while queue:
        n = queue.popleft()
        if n != none:
            order.append(n)
        for s in succ[n]:
            indeg[s] -= 1
            if not indeg[s]:
                queue.append(s)
    if len(order) != none:
        raise ValueError("lowered schedule has a dependency cycle (deadlock)")
    return order
