"""Every rank holding a last stage returns the losses of every micro-batch.

Megatron's training loop reads the list the forward-backward function returns on the ranks where
``is_pipeline_last_stage(ignore_virtual=True)`` holds and averages it over the micro-batches (then
over data-parallel replicas); ``is_last_rank`` prints it. Under a placement whose replicas end on
different ranks (bidirectional: the down replica's loss on rank 0, the up replica's on rank
``p-1``) each of those ranks computed the losses of its own replica's micro-batches only.
:func:`gather_losses` exchanges them within the pipeline group so that each returns all of them,
in micro-batch order: the logged loss is the mean over the whole batch, as under ``1f1b``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..schedules.ir import OpKind
from ..schedules.schedule import Schedule


def pp_group_of(kwargs: dict[str, Any]) -> Any:
    """The pipeline group megatron passes to the forward-backward function (or its default one)."""
    communicator = kwargs.get("p2p_communicator")
    if communicator is not None:
        return communicator.pp_group
    collection = kwargs.get("pg_collection")
    if collection is not None and getattr(collection, "pp", None) is not None:
        return collection.pp
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_group()


def loss_microbatches(schedule: Schedule, rank: int) -> list[int]:
    """Micro-batches whose loss ``rank`` computes, in the order it computes them."""
    placement = schedule.placement
    return [op.microbatch for op in schedule.ops[rank] if op.kind == OpKind.F and placement.is_last(op.stage)]


def loss_ranks(schedule: Schedule) -> list[int]:
    placement = schedule.placement
    return sorted({placement.rank_of(s) for s in range(placement.num_stages) if placement.is_last(s)})


def _to(entry: Any, device: Any) -> Any:
    if isinstance(entry, dict):
        return {key: _to(value, device) for key, value in entry.items()}
    if isinstance(entry, torch.Tensor):
        return entry.detach().to(device)
    return entry


def gather_losses(schedule: Schedule, pp_group: Any, store: list[Any]) -> list[Any]:
    """``store`` (this rank's loss entries) completed with the other loss ranks' ones on every loss rank.

    Collective over ``pp_group``: every rank of it calls this once per forward-backward call.
    """
    ranks = loss_ranks(schedule)
    if len(ranks) < 2:
        return store
    rank = pp_group.rank()
    mine = loss_microbatches(schedule, rank)
    if len(mine) != len(store):
        raise RuntimeError(
            f"pipeline rank {rank}: {len(store)} loss entries for {len(mine)} last-stage forwards "
            "(collect_non_loss_data is not supported under a placement with several loss ranks)"
        )
    device = next(
        (v.device for e in store for v in (e.values() if isinstance(e, dict) else [e]) if isinstance(v, torch.Tensor)),
        None,
    )
    every: list[Any] = [None] * pp_group.size()
    dist.all_gather_object(every, (mine, [_to(e, "cpu") for e in store]), group=pp_group)
    if rank not in ranks:
        return store
    by_microbatch: dict[int, Any] = {}
    for microbatches, entries in every:
        by_microbatch.update(zip(microbatches, entries, strict=True))
    if sorted(by_microbatch) != list(range(schedule.num_microbatches)):
        raise RuntimeError(f"pipeline rank {rank}: losses of micro-batches {sorted(by_microbatch)} gathered")
    return [_to(by_microbatch[mb], device) for mb in range(schedule.num_microbatches)]


_MTP_KEYS = ("loss_values", "correct_values", "total_values")


def mtp_tracker_snapshot(kwargs: dict[str, Any]) -> dict[str, torch.Tensor] | None:
    """Megatron's multi-token prediction metrics as this rank has tracked them so far (before a forward-backward
    call), or None when the model has no MTP layers (then :func:`share_mtp_metrics` does nothing)."""
    model = kwargs.get("model")
    chunk = model[0] if isinstance(model, list) else model
    while hasattr(chunk, "module") and not hasattr(chunk, "config"):
        chunk = chunk.module
    if not getattr(getattr(chunk, "config", None), "mtp_num_layers", None):
        return None
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    return {key: tracker[key].detach().clone() for key in _MTP_KEYS if key in tracker}


def share_mtp_metrics(pp_group: Any, before: dict[str, torch.Tensor] | None) -> None:
    """Each loss rank's MTP metrics of the last forward-backward call completed with the other loss ranks' ones.

    Megatron tracks the MTP losses on the stage computing them and logs one rank's tracker: under a placement
    whose model copies end on different ranks each tracked the micro-batches of its own copy only (half the
    logged MTP loss). Collective over ``pp_group`` (every rank calls it after every call when ``before`` is not
    None); the rest of the tracker, and megatron's own reduction at logging time, are untouched."""
    if before is None:
        return
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    added = {}
    for key in _MTP_KEYS:
        if key in tracker:
            now = tracker[key].detach()
            added[key] = (now - before[key] if key in before else now).cpu()
    every: list[Any] = [None] * pp_group.size()
    dist.all_gather_object(every, added, group=pp_group)
    if not added:  # no MTP layers on this rank: nothing of megatron's to complete
        return
    for key in added:
        total = sum((share[key] for share in every if share and key in share), torch.zeros_like(added[key]))
        tracker[key].copy_((before[key].cpu() if key in before else 0) + total)


def run_with_two_loss_ranks(executor_func: Any, kwargs: dict[str, Any], schedule: Schedule) -> list[Any]:
    """``executor_func(**kwargs)`` under a placement with several loss ranks: the returned losses
    (:func:`gather_losses`) and megatron's tracked MTP losses (:func:`share_mtp_metrics`) of every micro-batch."""
    before = mtp_tracker_snapshot(kwargs)
    result = executor_func(**kwargs)
    group = pp_group_of(kwargs)
    result = gather_losses(schedule, group, result)
    share_mtp_metrics(group, before)
    return result
