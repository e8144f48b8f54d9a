"""Data-parallel, FSDP and replica collectives, derived from a schedule's compute ops.

Like the point-to-point messages of :mod:`.lowering`, collectives are never written in a
schedule: this pass places them from the op order, the placement and a
:class:`CollectivePolicy`, and the executor, the validator and the simulator all read the
result. Positions are *gaps*: gap ``i`` of a rank is just before its op ``i``; gap
``len(ops)`` is after its last op.

Kinds:

* ``reduce-grads``: start the chunk's gradient reduction over its data-parallel group
  (all-reduce, or reduce-scatter under the distributed optimizer / FSDP), right after the
  chunk's last gradient-producing op of the iteration (the last of its ``B``, ``W``, ``BW``:
  a ``B`` still writes LayerNorm and embedding weight gradients). It runs on the data-parallel
  stream, overlapping the rest of the rank's backward work; the iteration waits for it at its end.
  With FSDP and ``grad_reduce_unit = U`` (a policy a schedule declares as
  ``Schedule.params["fsdp_grad_reduce_unit"]``; ZeroPP declares its scheduling unit) a chunk reduces
  once per *unit* instead: micro-batches ``[kU, (k+1)U)`` form unit ``k``, and right after the chunk's
  last gradient op of each unit its gradients so far are reduce-scattered and added into the sharded
  gradient, so the full-size gradient buffer is freed between units. ``ceil(m/U)`` reductions per
  chunk per iteration (``U >= m``: the one reduction above).
* ``param-sync``: the distributed optimizer's parameter all-gather of a chunk (megatron's
  ``param_sync_func``), just before the chunk's first forward.
* ``unshard`` / ``reshard`` (FSDP): gather a chunk's parameters before an op that reads its
  weights (``F``, ``B``, ``BW``; a ``W`` writes weight gradients only and needs no weights),
  free them again. At most ``fsdp_max_unsharded`` chunks of a rank are gathered at once; when
  another is needed, the gathered chunk whose next use is farthest away is resharded first
  (Belady's rule, which minimises the number of gathers), and a chunk is resharded right after
  its last use in the iteration. Under breadth-first order with a limit of 1 this gathers a
  chunk once per sweep (once for its forwards, once for its backwards) instead of once per
  micro-batch.
* ``replica-sync`` (bidirectional placements): all-reduce a chunk's gradients with the other
  replica's copy of the same model slice, on the rank that holds it. Both ranks of a pair must
  issue their syncs in the same order; the pass orders them by the pair's lower rank and places
  each no earlier than the chunk's last gradient-producing op on either side of it. With data
  parallelism too, a chunk's ``reduce-grads`` follows its ``replica-sync`` (both write the same
  gradients; sums commute, so the order is free, but they must not overlap).

A collective's ``stage`` names the chunk by its global stage (the rank's chunk is
``placement.chunk_of(stage)``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from .ir import OpKind, ScheduleError
from .schedule import Schedule

DP_GROUP = "dp"
REPLICA_GROUP = "replica"


class CollectiveKind(enum.StrEnum):
    REDUCE_GRADS = "reduce-grads"
    PARAM_SYNC = "param-sync"
    UNSHARD = "unshard"
    RESHARD = "reshard"
    REPLICA_SYNC = "replica-sync"


class Collective(NamedTuple):
    kind: CollectiveKind
    stage: int  # global stage of the chunk it acts on
    group: str = DP_GROUP

    def __str__(self) -> str:
        return f"{self.kind}[s{self.stage}]"


@dataclass(frozen=True)
class CollectivePolicy:
    """Which collectives a run needs (the runtime's data-parallel set-up decides it)."""

    reduce_grads: bool = True
    param_sync: bool = False  # distributed optimizer with overlapped parameter gathers
    fsdp_max_unsharded: int | None = None  # None: no FSDP; else chunks a rank may hold gathered at once
    replica_sync: bool = False  # bidirectional placements: sync the two copies of every stage
    # FSDP only: micro-batches per gradient reduction unit (None: one reduction per chunk per iteration)
    grad_reduce_unit: int | None = None

    def __post_init__(self) -> None:
        if self.fsdp_max_unsharded is not None and self.fsdp_max_unsharded < 1:
            raise ScheduleError(f"FSDP needs at least one gathered chunk at a time, got {self.fsdp_max_unsharded}")
        unit = self.grad_reduce_unit
        if unit is not None:
            if isinstance(unit, bool) or not isinstance(unit, int) or unit < 1:
                raise ScheduleError(f"grad_reduce_unit must be an integer >= 1 (micro-batches), got {unit!r}")
            if self.fsdp_max_unsharded is None:
                raise ScheduleError(
                    "grad_reduce_unit is an FSDP setting (reduce-scatter into the sharded gradient per unit): "
                    "an all-reduce or the distributed optimizer keeps the full gradient buffer anyway"
                )
            if self.replica_sync:
                raise ScheduleError("grad_reduce_unit with replica sync is not supported (one reduction per iteration)")


@dataclass(frozen=True)
class CollectivePlan:
    """Per rank, the collectives at each gap, in issue order: ``at[rank] = ((gap, collective), ...)``."""

    schedule: Schedule
    policy: CollectivePolicy
    at: tuple[tuple[tuple[int, Collective], ...], ...]

    def on_rank(self, rank: int) -> dict[int, tuple[Collective, ...]]:
        """``{gap: collectives issued there, in order}`` for one rank."""
        out: dict[int, list[Collective]] = {}
        for gap, collective in self.at[rank]:
            out.setdefault(gap, []).append(collective)
        return {gap: tuple(items) for gap, items in out.items()}

    def count(self, kind: CollectiveKind, rank: int | None = None) -> int:
        ranks = range(len(self.at)) if rank is None else (rank,)
        return sum(1 for r in ranks for _, c in self.at[r] if c.kind == kind)

    def describe(self, rank: int) -> str:
        ops = self.schedule.ops[rank]
        by_gap = self.on_rank(rank)
        lines = []
        for i in range(len(ops) + 1):
            lines += [f"  <{c}>" for c in by_gap.get(i, ())]
            if i < len(ops):
                lines.append(str(ops[i]))
        return "\n".join(lines)


_USES_WEIGHTS = (OpKind.F, OpKind.B, OpKind.BW)
_MAKES_GRADS = (OpKind.B, OpKind.W, OpKind.BW)


def derive_collectives(schedule: Schedule, policy: CollectivePolicy | None = None) -> CollectivePlan:
    """Place every collective ``policy`` asks for into every rank's op order (see the module doc)."""
    policy = policy or CollectivePolicy()
    if policy.replica_sync and schedule.placement.num_replicas != 2:
        raise ScheduleError(
            f"replica gradient sync needs a placement with two replicas, {schedule.name!r} has "
            f"{schedule.placement.num_replicas}"
        )
    per_rank: list[list[tuple[int, int, Collective]]] = []  # (gap, tie-break, collective)
    for rank, ops in enumerate(schedule.ops):
        items: list[tuple[int, int, Collective]] = []
        if policy.fsdp_max_unsharded is not None:
            items += _fsdp(schedule, rank, policy.fsdp_max_unsharded)
        if policy.param_sync:
            first: dict[int, int] = {}
            for i, op in enumerate(ops):
                if op.kind == OpKind.F:
                    first.setdefault(op.stage, i)
            items += [(i, 1, Collective(CollectiveKind.PARAM_SYNC, s)) for s, i in first.items()]
        if policy.reduce_grads:
            unit_ends = _unit_grad_gaps(schedule, rank, policy.grad_reduce_unit)
            items += [(gap, 0, Collective(CollectiveKind.REDUCE_GRADS, s)) for s, gap in unit_ends]
        per_rank.append(items)
    if policy.replica_sync:
        for rank, items in enumerate(_replica_syncs(schedule)):
            per_rank[rank] += items
            if policy.reduce_grads:  # both write the same gradients: the replica sum first, then data parallel
                synced = {c.stage: gap for gap, _, c in items}
                per_rank[rank] = [
                    (max(gap, synced[c.stage]), 3, c) if c.kind == CollectiveKind.REDUCE_GRADS else (gap, tie, c)
                    for gap, tie, c in per_rank[rank]
                ]
    # Within a gap: reshards and reductions of finished chunks first, then gathers for what comes.
    at = tuple(tuple((gap, c) for gap, _, c in sorted(items, key=lambda x: (x[0], x[1]))) for items in per_rank)
    return CollectivePlan(schedule, policy, at)


def _last_grad_gaps(schedule: Schedule, rank: int) -> dict[int, int]:
    """Global stage -> the gap right after its last gradient-producing op on ``rank``."""
    last: dict[int, int] = {}
    for i, op in enumerate(schedule.ops[rank]):
        if op.kind in _MAKES_GRADS:
            last[op.stage] = i + 1
    return dict(sorted(last.items(), key=lambda item: item[1]))


def _unit_grad_gaps(schedule: Schedule, rank: int, unit: int | None) -> list[tuple[int, int]]:
    """``(global stage, gap)`` right after the chunk's last gradient-producing op of each unit of ``unit``
    micro-batches (None: of the iteration), in gap order."""
    last: dict[tuple[int, int], int] = {}
    for i, op in enumerate(schedule.ops[rank]):
        if op.kind in _MAKES_GRADS:
            last[(op.stage, 0 if unit is None else op.microbatch // unit)] = i + 1
    return sorted(((stage, gap) for (stage, _), gap in last.items()), key=lambda item: item[1])


def _fsdp(schedule: Schedule, rank: int, limit: int) -> list[tuple[int, int, Collective]]:
    """Unshard before use, reshard by Belady's rule and after the last use."""
    ops = schedule.ops[rank]
    uses = [i for i, op in enumerate(ops) if op.kind in _USES_WEIGHTS]
    next_use: dict[int, int] = {}  # position in ``uses`` -> next position using the same stage
    seen: dict[int, int] = {}
    for k in range(len(uses) - 1, -1, -1):
        stage = ops[uses[k]].stage
        next_use[k] = seen.get(stage, len(ops) + 1)
        seen[stage] = uses[k]
    gathered: dict[int, int] = {}  # stage -> index of its next use
    items: list[tuple[int, int, Collective]] = []
    for k, i in enumerate(uses):
        stage = ops[i].stage
        if stage not in gathered:
            if len(gathered) >= limit:
                victim = max(gathered, key=lambda s: (gathered[s], s))
                del gathered[victim]
                items.append((i, 0, Collective(CollectiveKind.RESHARD, victim)))
            items.append((i, 2, Collective(CollectiveKind.UNSHARD, stage)))
        gathered[stage] = next_use[k]
        if next_use[k] > len(ops):  # its last use: free it right after
            del gathered[stage]
            items.append((i + 1, 0, Collective(CollectiveKind.RESHARD, stage)))
    return items


def declared_fsdp_limit(schedule: Schedule) -> int | None:
    """The gathered-chunk limit a schedule declares for FSDP (``Schedule.params["fsdp_max_unsharded"]``,
    e.g. 1 for breadth-first orders), or None when it declares none."""
    limit = schedule.params.get("fsdp_max_unsharded")
    return limit if isinstance(limit, int) and not isinstance(limit, bool) else None


def declared_grad_reduce_unit(schedule: Schedule) -> int | None:
    """Micro-batches per FSDP gradient reduction a schedule declares
    (``Schedule.params["fsdp_grad_reduce_unit"]``, e.g. ZeroPP's unit size), or None (once per iteration)."""
    unit = schedule.params.get("fsdp_grad_reduce_unit")
    return unit if isinstance(unit, int) and not isinstance(unit, bool) else None


def fsdp_policy(
    schedule: Schedule,
    fsdp_max_unsharded: int | None = None,
    grad_reduce_unit: int | None = None,
    **policy: bool,
) -> CollectivePolicy:
    """An FSDP policy with the schedule's declared settings where none is given: the gathered-chunk limit
    (else 1) and the gradient reduction unit (else once per iteration). ``policy``: the other fields."""
    limit = fsdp_max_unsharded if fsdp_max_unsharded is not None else (declared_fsdp_limit(schedule) or 1)
    unit = grad_reduce_unit if grad_reduce_unit is not None else declared_grad_reduce_unit(schedule)
    if unit is not None and (unit >= schedule.num_microbatches or not policy.get("reduce_grads", True)):
        unit = None  # one unit holds every micro-batch: the plain once-per-iteration reduction
    return CollectivePolicy(fsdp_max_unsharded=limit, grad_reduce_unit=unit, **policy)


def policy_for(
    schedule: Schedule,
    *,
    fsdp: bool = False,
    distributed_optimizer: bool = False,
    fsdp_max_unsharded: int | None = None,
    grad_reduce_unit: int | None = None,
) -> CollectivePolicy:
    """The policy of a data-parallel set-up: gradients reduced per chunk (with FSDP per unit when the
    schedule declares one or ``grad_reduce_unit`` is given); FSDP gathers with ``fsdp_max_unsharded``
    (default: the schedule's declared limit, else 1); the distributed optimizer's parameter gathers unless
    FSDP gathers anyway; replica syncs for two-replica placements."""
    replica = schedule.placement.num_replicas == 2
    if fsdp:
        return fsdp_policy(schedule, fsdp_max_unsharded, grad_reduce_unit, reduce_grads=True, replica_sync=replica)
    for name, value in (("fsdp_max_unsharded", fsdp_max_unsharded), ("grad_reduce_unit", grad_reduce_unit)):
        if value is not None:
            raise ScheduleError(f"{name} is an FSDP setting: give it together with FSDP")
    return CollectivePolicy(reduce_grads=True, param_sync=distributed_optimizer, replica_sync=replica)


def reduces_by_scatter(policy: CollectivePolicy) -> bool:
    """Whether ``reduce-grads`` is a reduce-scatter (distributed optimizer, FSDP) or an all-reduce."""
    return policy.param_sync or policy.fsdp_max_unsharded is not None


def mirror_rank(num_ranks: int, rank: int) -> int:
    """The rank holding the other replica's copy of this rank's model slices (bidirectional)."""
    return num_ranks - 1 - rank


def _replica_syncs(schedule: Schedule) -> list[list[tuple[int, int, Collective]]]:
    placement = schedule.placement
    p = schedule.num_ranks
    last = [_last_grad_gaps(schedule, rank) for rank in range(p)]
    out: list[list[tuple[int, int, Collective]]] = [[] for _ in range(p)]
    for rank in range(p):
        other = mirror_rank(p, rank)
        if other < rank:
            continue
        # model slice -> local stage on each side
        mine = {placement.model_slice_of(s): s for s in placement.stages_on_rank(rank)}
        theirs = {placement.model_slice_of(s): s for s in placement.stages_on_rank(other)}
        if rank == other:  # odd p: the middle rank holds both copies; a local sum would do
            raise ScheduleError(f"replica sync needs an even number of ranks, got p={p}")
        if set(mine) != set(theirs):
            raise ScheduleError(f"ranks {rank} and {other} do not hold the same model slices: no replica pairs")
        order = sorted(mine, key=lambda sl: (max(last[rank].get(mine[sl], 0), last[other].get(theirs[sl], 0)), sl))
        floor = {rank: 0, other: 0}
        for sl in order:
            for r, stage in ((rank, mine[sl]), (other, theirs[sl])):
                gap = max(last[r].get(stage, 0), floor[r])
                floor[r] = gap
                out[r].append((gap, 1, Collective(CollectiveKind.REPLICA_SYNC, stage, REPLICA_GROUP)))
    return out


def check_collectives(plan: CollectivePlan) -> None:
    """Every chunk reduced once after its last gradient op (per unit: once right after its last gradient op
    of each unit), gathered before every weight use (FSDP),
    replica pairs issuing their syncs in the same order. Raises :class:`ScheduleError`."""
    schedule, policy = plan.schedule, plan.policy
    for rank, ops in enumerate(schedule.ops):
        by_gap = plan.on_rank(rank)
        stages = set(schedule.placement.stages_on_rank(rank))
        # found again here, not through derive's helper, so that a bug there cannot hide from the check
        last = {op.stage: i + 1 for i, op in enumerate(ops) if op.kind in _MAKES_GRADS}
        unit = policy.grad_reduce_unit
        due: dict[int, set[int]] = {}  # per unit: a reduction right after the chunk's last gradient op of the unit
        if unit is not None:
            unit_last = {
                (op.stage, op.microbatch // unit): i + 1 for i, op in enumerate(ops) if op.kind in _MAKES_GRADS
            }
            for (stage, _), gap in unit_last.items():
                due.setdefault(stage, set()).add(gap)
        reduced: dict[int, int] = {}
        reduced_at: dict[int, set[int]] = {}
        gathered: set[int] = set()
        for i in range(len(ops) + 1):
            for c in by_gap.get(i, ()):
                if c.stage not in stages:
                    raise ScheduleError(f"rank {rank}: {c} at gap {i} names a stage this rank does not hold")
                if c.kind == CollectiveKind.REDUCE_GRADS:
                    if unit is not None:
                        if i not in due.get(c.stage, ()) or i in reduced_at.get(c.stage, ()):
                            raise ScheduleError(
                                f"rank {rank}: {c} at gap {i}: with a reduction per unit of {unit} micro-batches it "
                                f"is due once right after the chunk's last gradient op of each unit, at gaps "
                                f"{sorted(due.get(c.stage, ()))}"
                            )
                        reduced_at.setdefault(c.stage, set()).add(i)
                        reduced[c.stage] = i
                        continue
                    if c.stage in reduced:
                        raise ScheduleError(f"rank {rank}: {c} issued twice (gaps {reduced[c.stage]} and {i})")
                    if i < last.get(c.stage, 0):
                        raise ScheduleError(f"rank {rank}: {c} at gap {i} before the chunk's last gradient op")
                    reduced[c.stage] = i
                elif c.kind == CollectiveKind.UNSHARD:
                    gathered.add(c.stage)
                elif c.kind == CollectiveKind.RESHARD:
                    gathered.discard(c.stage)
            if policy.fsdp_max_unsharded is not None:
                if len(gathered) > policy.fsdp_max_unsharded:
                    raise ScheduleError(
                        f"rank {rank}: {len(gathered)} chunks gathered at gap {i}, limit {policy.fsdp_max_unsharded}"
                    )
                if i < len(ops) and ops[i].kind in _USES_WEIGHTS and ops[i].stage not in gathered:
                    raise ScheduleError(f"rank {rank}: {ops[i]} runs while its chunk is sharded (no unshard before it)")
        if policy.fsdp_max_unsharded is not None and gathered:
            raise ScheduleError(f"rank {rank}: chunks {sorted(gathered)} still gathered at the end of the iteration")
        if policy.reduce_grads and set(reduced) != set(last):
            raise ScheduleError(f"rank {rank}: chunks {sorted(set(last) - set(reduced))} never reduce their gradients")
        for stage, gaps in sorted(due.items()):
            missing = sorted(gaps - reduced_at.get(stage, set()))
            if policy.reduce_grads and missing:
                raise ScheduleError(
                    f"rank {rank}: chunk s{stage} reduces {len(gaps) - len(missing)} of its {len(gaps)} units' "
                    f"gradients; none after the unit's last gradient op at gaps {missing}"
                )
    if policy.replica_sync:
        placement = schedule.placement
        for rank in range(schedule.num_ranks):
            other = mirror_rank(schedule.num_ranks, rank)
            seq, peer = (
                [placement.model_slice_of(c.stage) for _, c in plan.at[r] if c.kind == CollectiveKind.REPLICA_SYNC]
                for r in (rank, other)
            )
            if seq != peer:
                raise ScheduleError(
                    f"ranks {rank} and {other} issue replica syncs in different orders (model slices {seq} vs {peer}):"
                    " the collectives would deadlock or pair the wrong tensors"
                )


__all__ = [
    "DP_GROUP",
    "REPLICA_GROUP",
    "Collective",
    "CollectiveKind",
    "CollectivePlan",
    "CollectivePolicy",
    "check_collectives",
    "declared_fsdp_limit",
    "declared_grad_reduce_unit",
    "derive_collectives",
    "fsdp_policy",
    "mirror_rank",
    "policy_for",
    "reduces_by_scatter",
]
