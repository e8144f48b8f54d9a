"""``megatron-pp verify --post-validation``: the same schedule, ranks, model and data stepped by
megatron-core's synchronous optimizer and by :class:`~..runtime.post_validation.PostValidatedOptimizer`;
the weights after the last step must be equal (bitwise, see :func:`compare_weights`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from . import criterion
from .rank_pool import check_errors
from .rank_run import TrainingRankPool
from .run_spec import OURS, RunHooks, RunSpec


@dataclass
class PostValidationReport:
    schedule: str
    p: int
    iterations: int
    ok: bool
    bitwise_equal: bool
    max_abs_weight_diff: float
    compared: int  # parameters compared
    # per step: the gradient norm megatron's synchronous step used (inf: skipped), and whether every
    # stage of the post-validated run validated against exactly that norm
    sync_norms: list[float] = field(default_factory=list)
    norms_equal: bool = False
    # per pipeline rank (tp 0, dp 0): PostValidationStats as a dict
    stats: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def rollbacks(self) -> int:
        return sum(s["rollbacks"] for s in self.stats)

    @property
    def redos(self) -> int:
        return sum(s["redos"] for s in self.stats)

    def to_json_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "rollbacks": self.rollbacks, "redos": self.redos}


def run_pair(
    schedule: Any,
    pool: TrainingRankPool,
    *,
    clip_grad: float = 0.0,
    loss_scale: float | None = 1.0,
    inject_inf: tuple[tuple[int, int], ...] = (),
    iterations: int = 3,
    dp: int = 1,
    tp: int = 1,
    distributed_optimizer: bool = False,
    lr: float = 1e-3,
    adam_eps: float = criterion.ADAM_EPS,
    model: Any = None,
    timeout_s: float = 60.0,
    fn: Any = None,
    late: bool = False,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(synchronous run, post-validated run) results. ``fn`` replaces the rank entry point of the
    post-validated run (tests use it to break the rollback on purpose). ``late``: validate after the next
    iteration's forward-backward (run again when validation changed weights) instead of before it.
    ``adam_eps`` defaults to verification's (see :mod:`.criterion`): with it Adam's update is a
    Lipschitz function of the gradient, so a last-bit difference in a clip coefficient stays a
    last-bit difference in the weights instead of being amplified by 1/eps near zero gradients."""
    from .tiny_gpt import TinyGPTSpec

    common: dict[str, Any] = {
        "pp": schedule.num_ranks,
        "num_microbatches": schedule.num_microbatches,
        "schedule_csv": schedule.to_csv(),
        "mode": OURS,
        "tp": tp,
        "dp": dp,
        "model": model or TinyGPTSpec(num_layers=schedule.placement.stages_per_replica),
        "iterations": iterations,
        "split_backward": schedule.splits_backward,
        "lr": lr,
        "adam_eps": adam_eps,
        "timeout_s": timeout_s,
        "megatron_optimizer": True,
        "distributed_optimizer": distributed_optimizer,
        "clip_grad": clip_grad,
        "loss_scale": loss_scale,
        "hooks": RunHooks(inject_inf=inject_inf),
        "keep_weights": True,
        "keep_grads": False,
    }
    sync = pool.run(RunSpec(**common))
    check_errors(sync)
    spec = RunSpec(**common, post_validation=True, post_validation_late=late)
    if fn is None:
        post = pool.run(spec)
    else:
        post = pool.run_fn(fn, spec, spec.world_size, spec.timeout_s * 4 + 120)
    check_errors(post)
    return sync, post


def compare_weights(name: str, sync: list[dict[str, Any]], post: list[dict[str, Any]]) -> PostValidationReport:
    """Every parameter of every rank after the last step: post-validated against synchronous."""
    import torch

    want = {k: w for r in sync for k, w in r["weights"].items()}
    got = {k: w for r in post for k, w in r["weights"].items()}
    problems = [f"{k}: missing in the post-validated run" for k in sorted(set(want) - set(got))]
    bitwise, diff = True, 0.0
    for key in sorted(set(want) & set(got)):
        a, b = want[key], got[key]
        if not torch.equal(a, b):
            bitwise = False
            diff = max(diff, float((a - b).abs().max()))
    stats = [
        r["post_validation"]
        for r in sorted(post, key=lambda r: r["pp_rank"])
        if r["tp_rank"] == 0 and r["dp_rank"] == 0
    ]
    iterations = len(post[0]["losses"])
    sync_norms = sync[0]["step_norms"]
    norms_equal = all(s["complete_norms"] == sync_norms for s in stats) and all(
        r["step_norms"] == sync_norms for r in sync
    )
    return PostValidationReport(
        schedule=name,
        p=len(stats),
        iterations=iterations,
        ok=bitwise and not problems,
        bitwise_equal=bitwise,
        max_abs_weight_diff=diff,
        compared=len(set(want) & set(got)),
        sync_norms=sync_norms,
        norms_equal=norms_equal,
        stats=stats,
        problems=problems,
    )


def verify_post_validation(schedule: Any, pool: TrainingRankPool | None = None, **kwargs: Any) -> PostValidationReport:
    """Run :func:`run_pair` (own pool unless given) and compare."""
    world = schedule.num_ranks * kwargs.get("tp", 1) * kwargs.get("dp", 1)
    own = pool is None
    pool = pool or TrainingRankPool(world)
    try:
        sync, post = run_pair(schedule, pool, **kwargs)
    finally:
        if own:
            pool.close()
    return compare_weights(schedule.name, sync, post)
