"""The two-replica feature (BitPipe's bidirectional placement): each rank holds a chunk of both model
replicas, kept equal by a gradient all-reduce between the copies (:mod:`..replicas`), and the loss,
computed on two ranks, reaches both with every micro-batch's value (:mod:`..losses`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import replicas
from .base import Feature, ForwardBackward, Wiring, register

if TYPE_CHECKING:
    from .._patching import Patcher
    from ..config import PipelineConfig


class BitpipeReplicas(Feature):
    name = "replicas"

    def prepare(self, wiring: Wiring) -> None:
        two_replicas = wiring.placement.num_replicas == 2
        wiring.executor_options["replica_sync"] = replicas.ReplicaSyncForMegatron() if two_replicas else None
        if not two_replicas:
            return

        def gathered(forward_backward: ForwardBackward) -> ForwardBackward:
            def forward_backward_func(**kwargs: Any) -> Any:
                from ..losses import run_with_two_loss_ranks  # each replica's last rank gets every loss (MTP's too)

                return run_with_two_loss_ranks(forward_backward, kwargs, wiring.source(kwargs["num_microbatches"]))

            return forward_backward_func

        wiring.wrap(gathered)

    def activate(self, config: PipelineConfig, patcher: Patcher, wiring: Wiring) -> None:
        if wiring.placement.num_replicas == 2:
            replicas.activate(wiring.placement, patcher)


register(BitpipeReplicas())
