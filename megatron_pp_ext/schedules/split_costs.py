"""Per-stage op costs from an uneven layer split: a stage's F, B and W take time in proportion to its work.

A stage's *weight* is its transformer layers, plus ``embedding_weight`` on the first model stage when
``--account-for-embedding-in-pipeline-split`` is given and ``loss_weight`` on the last when
``--account-for-loss-in-pipeline-split`` is (megatron counts each as one layer there; without the flags the
split treats them as free and so does this). The costs a user gives (``--costs F,B,W``) are those of one stage
of the *even* split: each stage's cost is that times its weight over the mean weight, so an even split keeps
the given costs and the total work of the pipeline stays what the costs say whatever the split. Stage ``s``
of the schedule gets the weight of its model stage (both replicas of a bidirectional placement hold the same).

:func:`stage_costs_from_layout` is what ``simulate`` reads; ``auto``'s planner weighs each stage by its layers in
the same way with its own per-layer costs (the split from the same parser, :mod:`.layer_split`). Pure Python.
"""

from __future__ import annotations

from .costs import Costs, expand_cost
from .layer_split import LayerSplit, placement_layer_counts, stage_layer_counts
from .placement import Placement

__all__ = ["stage_costs_from_layout", "stage_weights"]


def stage_weights(
    num_layers: int,
    num_model_stages: int,
    split: LayerSplit | None = None,
    *,
    embedding_weight: float = 1.0,
    loss_weight: float = 1.0,
) -> list[float]:
    """Work of each model stage in layers (raises :class:`~.layer_split.LayerSplitError` where the split does
    not map onto ``num_model_stages`` stages)."""
    split = split or LayerSplit()
    weights = [float(n) for n in stage_layer_counts(num_layers, num_model_stages, split)]
    if split.embedding:
        weights[0] += embedding_weight
    if split.loss:
        weights[-1] += loss_weight
    return weights


def stage_costs_from_layout(
    costs: Costs,
    placement: Placement,
    num_layers: int,
    split: LayerSplit | None = None,
    *,
    embedding_weight: float = 1.0,
    loss_weight: float = 1.0,
) -> Costs:
    """``costs`` (one stage of the even split) as per-global-stage costs for ``split`` of ``num_layers`` layers
    over ``placement``'s model stages. ``t_comm`` is unchanged (an activation has the same size on every stage).
    Costs already given per stage are scaled stage by stage."""
    placement_layer_counts(num_layers, placement, split)  # refuses a split megatron applies per rank
    weights = stage_weights(
        num_layers,
        placement.stages_per_replica,
        split,
        embedding_weight=embedding_weight,
        loss_weight=loss_weight,
    )
    mean = sum(weights) / len(weights)
    if mean <= 0:
        return costs
    scale = [weights[placement.model_slice_of(s)] / mean for s in range(placement.num_stages)]

    def scaled(name: str) -> tuple[float, ...]:
        base = expand_cost(name, getattr(costs, name), placement.num_stages)
        return tuple(b * k for b, k in zip(base, scale, strict=True))

    t_bw = None if costs.t_bw is None else scaled("t_bw")
    return Costs(scaled("t_f"), scaled("t_b"), scaled("t_w"), t_bw, costs.t_comm)
