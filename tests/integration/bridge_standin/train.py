"""Stand-in of megatron-bridge 0.6.2 ``megatron/bridge/training/train.py`` (see ``__init__.py``).

Mirrored: the by-name import of ``forward_backward_pipelining_without_interleaving`` and
``get_forward_backward_func`` from ``megatron.core.pipeline_parallel.schedules``; ``train()`` taking the schedule
function once (``pp_size`` from the pipeline group, ``vp_size`` from the model config) before anything runs, and
replacing it with megatron's 1F1B on the ``dist_train`` path; ``train_step()``'s call with its keyword arguments."""

from __future__ import annotations

from typing import Any

from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.pipeline_parallel.schedules import (
    forward_backward_pipelining_without_interleaving,
    get_forward_backward_func,
)


def train(model_config: Any, vp_size: int | None, pg_collection: Any, dist_train: bool = False) -> tuple[Any, Any]:
    """The schedule function and communicator ``train()`` holds for the whole run."""
    p2p_communicator = P2PCommunicator(pp_group=pg_collection.pp, config=model_config)
    forward_backward_func = get_forward_backward_func(pp_size=pg_collection.pp.size(), vp_size=vp_size)
    if dist_train:
        forward_backward_func = forward_backward_pipelining_without_interleaving
    return forward_backward_func, p2p_communicator


def train_step(
    forward_backward_func: Any,
    forward_step_func: Any,
    data_iterator: Any,
    model: list[Any],
    num_microbatches: int,
    seq_length: int,
    micro_batch_size: int,
    p2p_communicator: Any,
    pg_collection: Any,
) -> Any:
    """One training step's forward-backward call, as Bridge makes it (no distillation: no shape adjustment)."""
    adjust_tensor_shapes_fn = None
    return forward_backward_func(
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        decoder_seq_length=seq_length,
        forward_only=False,
        adjust_tensor_shapes_fn=adjust_tensor_shapes_fn,
        p2p_communicator=p2p_communicator,
        pg_collection=pg_collection,
    )
