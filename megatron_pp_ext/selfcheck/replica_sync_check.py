"""Self-check of :mod:`~megatron_pp_ext.runtime.replica_sync` on real gloo ranks (one pipeline group).

Plain modules with known gradients (a function of rank, chunk and parameter, exact in fp32) and a
:class:`~megatron_pp_ext.runtime.replica_sync.ReplicaSyncer` driven gap by gap as an executor would: each
rank reports its summed gradients and the gaps where it issued each sync
(``tests/runtime/test_replica_sync.py`` checks them).
"""

from __future__ import annotations

from typing import Any

from ..verification.rank_setup import rank_process_group


def replica_sync_check(case: tuple[str, int, int], rank: int, init_method: str) -> dict[str, Any]:
    """Run on every rank of a ``p``-rank world, ``case = (schedule name, p, m)``; returns the summed
    gradients per chunk, the issued syncs ``(gap, stage)`` and the rank's number of ops."""
    import torch

    from ..runtime.replica_sync import ReplicaSyncer, new_replica_group
    from ..schedules import generate

    name, p, m = case
    with rank_process_group(rank, p, init_method, timeout_s=60.0, device="none") as dist:
        schedule = generate(name, p, m)
        group = new_replica_group(dist.group.WORLD)
        models = []
        for chunk in range(schedule.chunks_per_rank):
            module = torch.nn.Linear(3, 2)
            for i, param in enumerate(module.parameters()):  # gradient = f(rank, chunk), exact in fp32
                param.grad = torch.full_like(param, float(100 * rank + 10 * chunk + i))
            models.append(module)
        syncer = ReplicaSyncer(schedule, rank, models, group)
        for gap in range(len(schedule.ops[rank]) + 1):
            syncer.at_gap(gap)
        syncer.finish()
        return {
            "grads": [[param.grad[0].flatten()[0].item() for param in module.parameters()] for module in models],
            "issued": syncer.issued,
            "num_ops": len(schedule.ops[rank]),
        }
