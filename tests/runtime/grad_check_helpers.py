"""Rank functions that break the B/W split on purpose, for the runtime guard's tests."""

from __future__ import annotations

from typing import Any


def run_with_w_that_computes_nothing(spec: Any, rank: int, init_method: str) -> dict[str, Any]:
    """:func:`~megatron_pp_ext.verification.rank_run.run_on_rank` with every megatron-linear W closure a no-op."""
    from megatron_pp_ext.runtime import wgrad_hooks
    from megatron_pp_ext.verification.rank_run import run_on_rank

    original = wgrad_hooks._weight_grad_closure

    def broken(*args: Any, **kwargs: Any) -> Any:
        _run, held = original(*args, **kwargs)
        return (lambda: None), held

    wgrad_hooks._weight_grad_closure = broken
    try:
        return run_on_rank(spec, rank, init_method)
    finally:
        wgrad_hooks._weight_grad_closure = original
