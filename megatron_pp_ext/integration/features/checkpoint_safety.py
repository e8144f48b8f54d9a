"""The checkpoint feature: every torch-format save records the layer layout and every load checks it, a
checkpoint megatron cannot read stops the run (:mod:`..checkpoint`), and one run at a time saves into a
``--save`` directory (:mod:`..save_lock`). Set up by the training script for every run, plugin schedule
or not (a checkpoint of one placement loaded under another loads the wrong layers either way)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import Feature, Wiring, register

if TYPE_CHECKING:
    from .._patching import Patcher
    from ..config import PipelineConfig


class CheckpointSafety(Feature):
    name = "checkpoints"
    megatron_flags = ("--save", "--load", "--ckpt-format")

    def prepare_training(self, args: Any) -> None:
        from ..checkpoint import check_torch_checkpoint_layouts
        from ..save_lock import hold_save_dir_lock

        check_torch_checkpoint_layouts()
        hold_save_dir_lock(args)

    def activate(self, config: PipelineConfig, patcher: Patcher, wiring: Wiring) -> None:
        """A load's layout check names the installed schedule (megatron's args name it otherwise)."""
        from .. import checkpoint

        checkpoint.set_installed_label(config.label)
        patcher.on_restore(lambda: checkpoint.set_installed_label(None))


register(CheckpointSafety())
