"""Rank functions for the post-validation tests: a broken rollback, and a recorder of the
communication each optimizer step issues."""

from __future__ import annotations

import types
from typing import Any

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce_scatter_tensor",
    "broadcast",
    "barrier",
)
POINT_TO_POINT = ("send", "recv", "isend", "irecv")


def run_with_broken_rollback(spec: Any, rank: int, init_method: str) -> dict[str, Any]:
    """:func:`~megatron_pp_ext.verification.rank_run.run_on_rank` whose snapshots restore nothing."""
    from megatron_pp_ext.runtime import post_validation
    from megatron_pp_ext.verification.rank_run import run_on_rank

    original = post_validation._Snapshot.restore
    post_validation._Snapshot.restore = lambda self: None  # type: ignore[method-assign]
    try:
        return run_on_rank(spec, rank, init_method)
    finally:
        post_validation._Snapshot.restore = original  # type: ignore[method-assign]


def run_recording_step_communication(spec: Any, rank: int, init_method: str) -> dict[str, Any]:
    """:func:`run_on_rank`, recording every torch.distributed call made inside an optimizer's
    ``step()`` (megatron's ChainedOptimizer or the post-validated wrapper) and inside ``validate()``:
    ``result["calls"]`` is a list of (phase, function, group ranks, peer) per call."""
    import torch.distributed as dist
    from megatron.core.optimizer.optimizer import ChainedOptimizer

    from megatron_pp_ext.runtime import post_validation
    from megatron_pp_ext.verification.rank_run import run_on_rank

    calls: list[tuple[str, str, tuple[int, ...], int | None]] = []
    phase: list[str] = []
    saved: dict[str, Any] = {}

    def recorder(name: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if phase:
                group = kwargs.get("group")
                ranks = (
                    tuple(dist.get_process_group_ranks(group))
                    if group is not None
                    else tuple(range(dist.get_world_size()))
                )
                peer = kwargs.get("dst", kwargs.get("src"))
                calls.append((phase[-1], name, ranks, peer))
            return fn(*args, **kwargs)

        return wrapped

    def in_phase(label: str, fn: Any) -> Any:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            phase.append(label)
            try:
                return fn(*args, **kwargs)
            finally:
                phase.pop()

        return wrapped

    for name in COLLECTIVES:
        saved[name] = getattr(dist, name)
        setattr(dist, name, recorder(name, saved[name]))
    # point to point: only the wrapper's own (torch's P2POp refuses a wrapped isend/irecv, which the
    # executor's batched p2p would otherwise meet)
    proxy = types.SimpleNamespace(**{name: getattr(dist, name) for name in dir(dist) if not name.startswith("__")})
    for name in POINT_TO_POINT:
        setattr(proxy, name, recorder(name, getattr(dist, name)))
    post_validation.dist = proxy  # type: ignore[assignment]
    patched = [
        (ChainedOptimizer, "step"),
        (post_validation.PostValidatedOptimizer, "step"),
        (post_validation.PostValidatedOptimizer, "validate"),
    ]
    originals = [getattr(cls, attr) for cls, attr in patched]
    for (cls, attr), fn in zip(patched, originals, strict=True):
        setattr(cls, attr, in_phase(attr, fn))
    try:
        result = run_on_rank(spec, rank, init_method)
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        post_validation.dist = dist  # type: ignore[assignment]
        for (cls, attr), fn in zip(patched, originals, strict=True):
            setattr(cls, attr, fn)
    result["calls"] = calls
    result["rank"] = rank
    return result
