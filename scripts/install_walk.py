"""The walk of ``install(args)``: which of the package's modules a call enters, in order, and how often.

Calls ``install(args)`` on megatron-style args (no process group; megatron imported with the CPU shim)
under a profiler and prints the rooms entered: each change of module between one call and the next.
Modules of ``integration/`` are shown by name, the other layers by their package (``schedules``,
``analysis``, ``runtime``, ...), so the count says how often the flag and install code hands over to
another module of its own. Usage::

    PYTHONPATH=$PWD python scripts/install_walk.py [--pipeline-schedule v-zb ...]
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_pp_ext.integration import cpu

PREFIX = "megatron_pp_ext."
DEFAULT_ARGV = ["--pipeline-schedule", "v-zb", "--pipeline-costs", "1,1,1,0"]
MEGATRON_ARGS: dict[str, Any] = {
    "pipeline_model_parallel_size": 4,
    "virtual_pipeline_model_parallel_size": None,
    "num_virtual_stages_per_pipeline_rank": None,
    "num_layers_per_virtual_pipeline_stage": None,
    "pipeline_model_parallel_layout": None,
    "decoder_first_pipeline_num_layers": None,
    "decoder_last_pipeline_num_layers": None,
    "microbatch_group_size_per_vp_stage": None,
    "num_layers": 8,
    "micro_batch_size": 1,
    "global_batch_size": 8,
    "data_parallel_size": 1,
    "eval_iters": 0,
    "distributed_backend": "gloo",
    "transformer_impl": "local",
    "gradient_accumulation_fusion": False,
}


def room(module: str) -> str:
    """``integration.<module>`` (features included) by name, any other layer by its package."""
    parts = module[len(PREFIX) :].split(".")
    return ".".join(parts) if parts[0] == "integration" else parts[0]


def walk(argv: list[str]) -> list[str]:
    cpu._define_typing_override()  # megatron's import-time shims only, as the integration tests do
    cpu._stub_triton_modules()
    import megatron.core.pipeline_parallel.schedules
    import megatron.training.training  # noqa: F401

    from megatron_pp_ext.integration import install as inst
    from megatron_pp_ext.integration.flags import add_arguments

    args = add_arguments(argparse.ArgumentParser()).parse_args(argv)
    for key, value in MEGATRON_ARGS.items():
        setattr(args, key, value)
    rooms: list[str] = []

    def profile(frame: FrameType, event: str, _: Any) -> None:
        if event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if module.startswith(PREFIX):
            here = room(module)
            if not rooms or rooms[-1] != here:
                rooms.append(here)

    sys.setprofile(profile)
    try:
        inst.install(args)
    finally:
        sys.setprofile(None)
        inst.uninstall()
    return rooms


def main() -> int:
    argv = sys.argv[1:] or DEFAULT_ARGV
    rooms = walk(argv)
    print(f"install({' '.join(argv)}): {len(rooms)} rooms entered, {len(set(rooms))} distinct")
    print(" -> ".join(rooms))
    for name, count in collections.Counter(rooms).most_common():
        print(f"{count:4d}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
