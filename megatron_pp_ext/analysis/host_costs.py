"""A measured host cost per op and per exchange, charged by the simulator as busy time of the rank.

The simulator's op costs are compute only and its ``t_comm`` is the hop between ranks; neither holds the Python
around each op (the executor's bookkeeping) or the sender's cost of posting an exchange (gloo's ``isend`` and
the executor's code around it), which a real run pays on the rank's own time. :func:`with_host_costs` adds both
to the op costs: ``per_op`` to every op, ``per_exchange`` to every op whose output crosses to another rank (a
forward whose next stage lives elsewhere, a backward whose previous stage does). Both default to 0, so a
simulation without measured host costs is the plain one. Pure; no torch.
"""

from __future__ import annotations

from ..schedules.costs import Costs
from ..schedules.placement import Placement

__all__ = ["sends_off_rank", "with_host_costs"]


def sends_off_rank(placement: Placement, stage: int, forward: bool) -> bool:
    """Whether a forward (``forward``) or backward (``B``/``BW``) of ``stage`` sends its output to another rank:
    the ops :func:`with_host_costs` charges the per-exchange cost to."""
    neighbour = placement.next_stage(stage) if forward else placement.prev_stage(stage)
    return neighbour is not None and placement.rank_of(neighbour) != placement.rank_of(stage)


def with_host_costs(costs: Costs, placement: Placement, per_op: float = 0.0, per_exchange: float = 0.0) -> Costs:
    """``costs`` with ``per_op`` added to every op kind of every stage and ``per_exchange`` to the ops that
    send to another rank (the same unit as ``costs``). ValueError for a negative cost."""
    for name, value in (("per_op", per_op), ("per_exchange", per_exchange)):
        if not value >= 0.0:
            raise ValueError(f"host cost {name} must be >= 0, got {value}")
    n = placement.num_stages
    t_f, t_b, t_w, t_bw = costs.per_stage(n)

    forward = [per_op + (per_exchange if sends_off_rank(placement, s, True) else 0.0) for s in range(n)]
    backward = [per_op + (per_exchange if sends_off_rank(placement, s, False) else 0.0) for s in range(n)]
    return Costs(
        tuple(a + x for a, x in zip(t_f, forward, strict=True)),
        tuple(a + x for a, x in zip(t_b, backward, strict=True)),
        tuple(a + per_op for a in t_w),
        tuple(a + x for a, x in zip(t_bw, backward, strict=True)),
        costs.t_comm,
    )
