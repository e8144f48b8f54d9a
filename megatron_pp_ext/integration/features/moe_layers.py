"""The MoE feature: megatron's mixture-of-experts layers under CPU mode and the plugin's schedules. The
combinations that cannot run are refused by :mod:`..moe_flags`' checks, which this adapter runs in the
features' order; nothing is patched (the executor runs MoE layers as any other)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .. import moe_flags
from .base import Feature, register

if TYPE_CHECKING:
    from ..config import PipelineConfig


class MoeLayers(Feature):
    name = "moe"
    megatron_flags = (
        "--moe-grouped-gemm",
        "--moe-use-legacy-grouped-gemm",
        "--moe-token-dispatcher-type",
        "--moe-paged-stash",
        "--overlap-moe-expert-parallel-comm",
        "--delay-wgrad-compute",
    )

    def check(self, args: Any, config: PipelineConfig) -> None:
        if getattr(args, "cpu", False):
            moe_flags.check_cpu(args)
        if config.selected:
            moe_flags.check_schedule(args)


register(MoeLayers())
