"""Stand-in of megatron-bridge 0.6.2 ``megatron/bridge/training/eval.py`` (see ``__init__.py``).

Mirrored: the by-name import of ``get_forward_backward_func`` from ``megatron.core.pipeline_parallel`` (the
package, not its schedules module); ``evaluate()`` taking the schedule function per call, except for a
multimodule model, which gets megatron's 1F1B (imported inside the function, as Bridge does); its two calls
(losses, then non-loss data) with their keyword arguments."""

from __future__ import annotations

from typing import Any

from megatron.core.pipeline_parallel import get_forward_backward_func


def evaluate(
    forward_step_func: Any,
    data_iterator: Any,
    model: list[Any],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    vp_size: int | None,
    p2p_communicator: Any,
    pg_collection: Any,
    is_multimodule: bool = False,
) -> Any:
    """One evaluation iteration's loss pass."""
    if is_multimodule:
        from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_without_interleaving

        forward_backward_func = forward_backward_pipelining_without_interleaving
    else:
        forward_backward_func = get_forward_backward_func(pp_size=pg_collection.pp.size(), vp_size=vp_size)
    adjust_tensor_shapes_fn = None
    return forward_backward_func(
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=True,
        adjust_tensor_shapes_fn=adjust_tensor_shapes_fn,
        p2p_communicator=p2p_communicator,
        pg_collection=pg_collection,
    )


def collect_non_loss_data(
    forward_step_func: Any,
    data_iterator: Any,
    model: list[Any],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    vp_size: int | None,
    p2p_communicator: Any,
    pg_collection: Any,
) -> Any:
    """The non-loss-data pass of an evaluation."""
    forward_backward_func = get_forward_backward_func(pp_size=pg_collection.pp.size(), vp_size=vp_size)
    return forward_backward_func(
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=True,
        collect_non_loss_data=True,
        p2p_communicator=p2p_communicator,
        pg_collection=pg_collection,
    )
