"""The post-validation feature: ``--pipeline-post-validation`` wraps megatron's optimizer so that its step is
validated after the next iteration's forward-backward (late) or before it (early), and redone when a rank
found a non-finite gradient (:mod:`..post_validation_training`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..config import PipelineArgumentError
from .base import Feature, ForwardBackward, Wiring, register

if TYPE_CHECKING:
    from .._patching import Patcher
    from ..config import PipelineConfig


class PostValidationStep(Feature):
    name = "post-validation"
    fields = ("post_validation", "post_validation_early")

    def check(self, args: Any, config: PipelineConfig) -> None:
        if not config.selected:
            return
        if config.post_validation_early and not config.post_validation:
            raise PipelineArgumentError("--pipeline-post-validation-early", "goes with --pipeline-post-validation")
        if config.post_validation and config.fsdp:
            raise PipelineArgumentError(
                "--pipeline-post-validation", "wraps megatron's optimizer: not with --pipeline-fsdp (its own optimizer)"
            )

    def prepare(self, wiring: Wiring) -> None:
        config = wiring.config
        if not config.post_validation:
            return

        def validated(forward_backward: ForwardBackward) -> ForwardBackward:
            def forward_backward_func(**kwargs: Any) -> Any:
                from ..post_validation_training import run  # the last step validated, after or before this pass

                return run(forward_backward, kwargs, late=not config.post_validation_early)

            return forward_backward_func

        wiring.wrap(validated)

    def activate(self, config: PipelineConfig, patcher: Patcher, wiring: Wiring) -> None:
        if config.post_validation:
            from .. import post_validation_training

            post_validation_training.patch_megatron(patcher)
            patcher.on_restore(post_validation_training.forget)


register(PostValidationStep())
