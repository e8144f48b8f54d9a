"""A rank process's distributed set-up and teardown, written once for every rank job of this package.

A rank job (:class:`~.rank_pool.RankPool` runs it, or a test spawns it) needs the same steps around
its work: the device set-up (megatron's CPU shims, or GPU 0 for ``verify``'s GPU check), the default
process group, megatron's model-parallel groups, and on the way out both torn down again, because pool
workers are reused by the next job. :func:`rank_process_group` does those steps as one context manager;
:func:`single_rank_group` is the one-rank variant for checks that run inside the calling process and
keep their group.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import socket
from collections.abc import Iterator
from typing import Any

DEVICES = ("auto", "cpu", "cuda", "none")


def prepare_device(device: str, stage_p2p_through_host: bool = False) -> None:
    """``"auto"``: megatron's CPU shims unless this machine has a GPU (the self-checks that also run on
    GPUs); ``"cpu"`` / ``"cuda"``: :func:`~.host_staging.prepare_rank` (CPU shims forced, or GPU 0 with
    host-staged p2p); ``"none"``: nothing (plain torch, no megatron)."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}, got {device!r}")
    if device == "none":
        return
    if device == "auto":
        from ..integration.cpu import enable_cpu_mode, hide_missing_accelerator_warnings

        hide_missing_accelerator_warnings(announce=False)  # before enable_cpu_mode imports megatron
        enable_cpu_mode()
        return
    from .host_staging import prepare_rank

    prepare_rank(device, stage_p2p_through_host)


def _timeout(seconds: float | None) -> dict[str, Any]:
    return {} if seconds is None else {"timeout": datetime.timedelta(seconds=seconds)}


@contextlib.contextmanager
def rank_process_group(
    rank: int,
    world_size: int,
    init_method: str,
    *,
    timeout_s: float | None = None,
    tp: int | None = None,
    pp: int | None = None,
    ep: int = 1,
    device: str = "auto",
    stage_p2p_through_host: bool = False,
    backend: str = "gloo",
) -> Iterator[Any]:
    """Set this rank up (:func:`prepare_device`), join the ``world_size``-rank group at ``init_method``
    and, unless ``tp`` and ``pp`` are both None, build megatron's model-parallel groups of those sizes
    (None counts as 1) and expert-parallel groups of size ``ep`` (carved out of the data-parallel
    ranks, as megatron does); yields ``torch.distributed``. On exit, whatever happened inside: the
    model-parallel groups and the process group are destroyed and the cycle collector runs.

    ``timeout_s``: the groups' collective timeout (None: torch's default). ``backend``: ``"gloo"``, or
    ``"auto"`` for NCCL where CUDA is available after the device set-up (the GPU runs of the self-checks).
    """
    prepare_device(device, stage_p2p_through_host)
    import torch
    import torch.distributed as dist

    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    model_parallel = tp is not None or pp is not None
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, **_timeout(timeout_s))
    try:
        if model_parallel:
            from megatron.core import parallel_state as ps

            ps.initialize_model_parallel(
                tensor_model_parallel_size=tp or 1, pipeline_model_parallel_size=pp or 1, expert_model_parallel_size=ep
            )
        yield dist
    finally:
        if model_parallel:
            from megatron.core import parallel_state as ps

            ps.destroy_model_parallel()
            _reset_moe_state()
        dist.destroy_process_group()
        # A run's megatron modules form reference cycles (the config holds DDP's bound sync functions, the
        # modules hold the config) that keep its process groups alive until the cycle collector runs, and
        # an idle pool worker allocates too little to trigger it: collect now, or each run's gloo groups
        # (~19 threads per run, spinning once their peers are gone) pile up in the reused worker.
        release_autograd_graphs()
        gc.collect()


def release_autograd_graphs() -> None:
    """Detach the tensors with autograd history that live modules still hold after a run.

    Such a tensor keeps its graph alive, and the graph holds the parameters' gradient accumulators with
    megatron DDP's hooks on them, whose closures hold the DDP wrapper and so the model: a cycle through
    C++ autograd nodes, which the cycle collector cannot see, so the run's modules and process groups
    are never freed. megatron's MoE token dispatcher leaves one (``probs`` of the last micro-batch, for
    its combine step). Looked for on every live module and on the megatron objects a module holds
    directly (the dispatcher is not a module); the run is over, so nothing reads them again."""
    import torch

    def detach_attributes(obj: Any, depth: int) -> None:
        for name, value in list(vars(obj).items()):
            if isinstance(value, torch.Tensor):
                if value.grad_fn is not None and not isinstance(value, torch.nn.Parameter):
                    setattr(obj, name, value.detach())
            elif depth == 0 and hasattr(value, "__dict__") and type(value).__module__.startswith("megatron"):
                if not isinstance(value, torch.nn.Module | type):
                    detach_attributes(value, 1)

    for obj in gc.get_objects():
        if isinstance(obj, torch.nn.Module):
            detach_attributes(obj, 0)


def _reset_moe_state() -> None:
    """megatron's process-wide MoE state, as a fresh process has it: the metrics tracker sizes its
    per-layer buffers by the first run's layer count, and the load-balancing loss scale keeps the
    first run's dtype."""
    from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    destroy_moe_metrics_tracker()
    MoEAuxLossAutoScaler.main_loss_backward_scale = None


def single_rank_group(timeout_s: float = 60.0) -> None:
    """This process as a one-rank gloo world on a free local port with megatron's model-parallel groups
    of size one, unless already set up; kept for the rest of the process (checks that run in the caller)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1, **_timeout(timeout_s)
        )
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=1)
