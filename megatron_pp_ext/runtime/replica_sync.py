"""Gradient sync between the two model replicas of a bidirectional placement (BitPipe).

Under the ``bidirectional`` placement rank ``r`` and its mirror ``p-1-r`` hold the two copies of
the same model slices (:func:`~megatron_pp_ext.schedules.collectives.mirror_rank`): each copy's
gradient covers only the micro-batches of its own replica, and the model's gradient is their sum.
Both copies start from the same weights (``tiny_gpt.build_chunks`` / a checkpoint copies them by
global layer number), so after an all-reduce (sum) of every chunk's gradients they take identical
optimizer steps and stay identical.

The schedule decides *when* each chunk syncs (``replica-sync`` collectives of
:func:`~megatron_pp_ext.schedules.collectives.derive_collectives`); this module does the work:

* :func:`new_replica_group`: the process group of this rank and its mirror, within its pipeline
  group (same tensor- and data-parallel coordinates). Every rank must call it, in the same order,
  like any ``new_group``. Data parallelism composes: megatron's DDP reduces over the data-parallel
  group as usual and the replica sum comes on top (the paper's "virtual data parallel" group is the
  union of the two; keeping them apart leaves megatron's DDP and distributed optimizer untouched).
* :func:`sync_chunk`: all-reduce one chunk's gradients (``main_grad`` under megatron DDP, else
  ``.grad``), async on request so that it overlaps the remaining backward work.
* :class:`ReplicaSyncer`: what an executor needs to run the schedule's ``replica-sync``
  collectives eagerly: ``at_gap(i)`` before the rank's compute op ``i`` (and ``at_gap(len(ops))``
  after its last), ``finish()`` before megatron's ``finalize_model_grads`` (which reads the same
  gradient buffers). Sums commute with megatron's data-parallel average and with the local tied
  embedding add, so their order does not matter; only in-flight all-reduces must be finished first.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..schedules.collectives import CollectiveKind, CollectivePolicy, derive_collectives, mirror_rank
from ..schedules.placement import Placement
from ..schedules.schedule import Schedule


def new_replica_group(pp_group: Any) -> Any:
    """The group {this rank, its mirror} of every pipeline group; collective over the whole world."""
    mine = dist.get_process_group_ranks(pp_group)
    every: list[list[int] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    pipelines = sorted({tuple(g) for g in every if g is not None})
    me = dist.get_rank()
    found = None
    for ranks in pipelines:
        p = len(ranks)
        for i in range(p // 2):
            pair = [ranks[i], ranks[mirror_rank(p, i)]]
            group = dist.new_group(pair)
            if me in pair:
                found = group
    if found is None:
        raise RuntimeError(f"rank {me} has no mirror rank: replica sync needs an even pipeline size")
    return found


def _mirror_global(group: Any) -> int:
    """The other member (global rank) of this rank's two-rank replica group."""
    me = dist.get_rank()
    others = [r for r in dist.get_process_group_ranks(group) if r != me]
    if len(others) != 1:
        raise RuntimeError(f"a replica group has two ranks, rank {me}'s has {len(others) + 1}")
    return others[0]


def copy_down_to_up(placement: Placement, rank: int, models: list[Any], group: Any) -> list[int]:
    """Give every up-replica copy (replica 1) the weights of its down-replica twin on the mirror rank.

    Rank ``r`` and its mirror hold both copies of the same model slices; for each slice, in
    ascending order (the order both agree on), the holder of the down copy broadcasts its
    parameters and the other rank writes them into its up copy. Returns the model slices received.
    """
    mirror = _mirror_global(group)
    received = []
    by_slice = sorted(range(len(models)), key=lambda c: placement.model_slice_of(placement.stage_at(rank, c)))
    for chunk in by_slice:
        stage = placement.stage_at(rank, chunk)
        params = [param.data for param in models[chunk].parameters()]
        if not params:
            continue
        down_here = placement.replica_of(stage) == 0
        flat = torch.cat([t.reshape(-1) for t in params])
        dist.broadcast(flat, src=dist.get_rank() if down_here else mirror, group=group)
        if not down_here:
            offset = 0
            for t in params:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
            received.append(placement.model_slice_of(stage))
    return received


def _grads(module: Any) -> list[torch.Tensor]:
    out = []
    for param in module.parameters():
        grad = getattr(param, "main_grad", None) if hasattr(param, "main_grad") else param.grad
        if grad is not None:
            out.append(grad)
    return out


def sync_chunk(module: Any, group: Any, async_op: bool = False) -> list[Any]:
    """Sum one chunk's gradients with the mirror rank's copy; returns the work handles if ``async_op``."""
    works = []
    grads = _grads(module)
    if not grads:
        return works
    flat = torch.cat([g.reshape(-1) for g in grads])
    work = dist.all_reduce(flat, group=group, async_op=async_op)

    def unpack() -> None:
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    if async_op:
        works.append(_Pending(work, unpack))
    else:
        unpack()
    return works


class _Pending:
    """An in-flight chunk sync: ``wait()`` finishes the all-reduce and writes the sums back."""

    def __init__(self, work: Any, unpack: Any) -> None:
        self.work, self.unpack = work, unpack

    def wait(self) -> None:
        self.work.wait()
        self.unpack()


def sync_all(placement: Placement, rank: int, models: list[Any], group: Any) -> None:
    """Sync every chunk, in the order both ranks of the pair agree on (their model slices, ascending)."""
    by_slice = sorted(range(len(models)), key=lambda c: placement.model_slice_of(placement.stage_at(rank, c)))
    for chunk in by_slice:
        sync_chunk(models[chunk], group)


class ReplicaSync:
    """The executor's side of the ``replica-sync`` collective: ``launch(chunk)`` starts the chunk's
    all-reduce with the mirror rank without waiting (the executor calls it where the collectives
    pass placed it); ``finish()`` waits for all of them, before megatron's ``finalize_model_grads``."""

    def __init__(self, models: list[Any], group: Any) -> None:
        self.models = models
        self.group = group
        self.pending: dict[int, list[Any]] = {}

    def launch(self, chunk: int) -> None:
        self.pending[chunk] = sync_chunk(self.models[chunk], self.group, async_op=True)

    def finish_chunk(self, chunk: int) -> None:
        """Wait for one chunk's sync (before another collective writes the same gradients)."""
        for work in self.pending.pop(chunk, ()):
            work.wait()

    def finish(self) -> None:
        for chunk in list(self.pending):
            self.finish_chunk(chunk)


class ReplicaSyncer:
    """Runs one rank's ``replica-sync`` collectives of ``schedule`` at their gaps, asynchronously."""

    def __init__(self, schedule: Schedule, rank: int, models: list[Any], group: Any) -> None:
        plan = derive_collectives(schedule, CollectivePolicy(reduce_grads=False, replica_sync=True))
        self.placement = schedule.placement
        self.models = models
        self.group = group
        self.at: dict[int, list[int]] = {}
        for gap, collective in plan.at[rank]:
            if collective.kind == CollectiveKind.REPLICA_SYNC:
                self.at.setdefault(gap, []).append(collective.stage)
        self.pending: list[Any] = []
        self.issued: list[tuple[int, int]] = []  # (gap, stage), for traces and tests

    def at_gap(self, gap: int) -> None:
        for stage in self.at.get(gap, ()):
            self.pending += sync_chunk(self.models[self.placement.chunk_of(stage)], self.group, async_op=True)
            self.issued.append((gap, stage))

    def finish(self) -> None:
        for work in self.pending:
            work.wait()
        self.pending = []
