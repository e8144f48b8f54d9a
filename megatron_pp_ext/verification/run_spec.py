"""What one distributed verification run does: :class:`RunSpec` (sent to every rank, picklable), its
run modes, and :class:`RunHooks`, the deliberate deviations that tests use to provoke a failure.

The spec is plain data: the driver (:mod:`.verify`), the references (:mod:`.reference`), the
benchmarks and the tests build specs; :mod:`.rank_run` executes one on each rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .tiny_gpt import TinyGPTSpec

NATIVE = "native"  # megatron-core's own forward_backward_func
OURS = "ours"  # megatron_pp_ext's executor
AB = "ab"  # timing: each iteration runs megatron's function and ours, in alternating order


@dataclass(frozen=True)
class RunHooks:
    """Testing aids: ways to make a run deliberately wrong or to reach code a normal run skips. A verify
    run leaves them all at their defaults; the references never get any but ``stage_p2p_through_host``."""

    # Deliberate faults injected into OURS runs (verification/breaks.py).
    breaks: tuple[str, ...] = ()
    # A different schedule for some pipeline ranks (to provoke a mismatch).
    schedule_csv_overrides: tuple[tuple[int, str], ...] = ()
    # A different schedule for some pipeline ranks from the re-plan on (to provoke a mismatch there).
    replan_overrides: tuple[tuple[int, str], ...] = ()
    # (iteration, pipeline rank) pairs whose first gradient element is made inf before the step.
    inject_inf: tuple[tuple[int, int], ...] = ()
    check_agreement: bool = True  # False skips the start-of-run schedule agreement
    stage_p2p_through_host: bool = False  # host staging on a CPU run too (always on with device "cuda")


@dataclass(frozen=True)
class RunSpec:
    """One distributed training run (picklable; sent to every rank)."""

    pp: int
    num_microbatches: int
    schedule_csv: str | None = None  # required for OURS
    mode: str = OURS
    tp: int = 1
    model: TinyGPTSpec = field(default_factory=TinyGPTSpec)
    iterations: int = 3
    use_ddp: bool = True
    sequence_parallel: bool = False
    forward_only: bool = False
    trace: bool = False
    split_backward: bool = False  # install the weight-gradient hooks (schedules with B/W ops)
    timeout_s: float = 60.0
    # False: every message carries tag 0, as on NCCL (which ignores tags): matching relies on order alone.
    p2p_tags: bool = True
    # Adam normalises every element, so fp32 re-association noise in near-zero gradients (the tied
    # embedding's two partial sums, backward orders that differ from the reference) becomes an
    # O(lr) weight difference after a step; a small lr keeps that noise far below the 1e-6
    # tolerance, while a schedule bug still shows up as an O(1) gradient difference.
    lr: float = 1e-4
    keep_grads: bool = True  # benchmarks turn this off
    # Profile-guided re-planning: build `replan_schedule` with default costs, re-plan after this many iterations.
    replan_schedule: str | None = None
    replan_memory_limit: float | None = None
    profile_iterations: int = 0
    replan_initial_costs: str | None = None  # "F,B,W,COMM" to start from instead of the generator's defaults
    # Data parallelism: dp replicas of the pipeline, each on its share of dp x num_microbatches
    # micro-batches. With dp > 1 gradients are reduced by megatron DDP with overlap_grad_reduce,
    # launched where the collectives pass places each chunk's reduction.
    dp: int = 1
    # MoE (model.num_experts): experts split over this many of the data-parallel ranks (megatron's expert
    # parallelism: the token dispatcher's all-to-all runs among them); must divide dp and num_experts.
    ep: int = 1
    # MoE: every F, B/BW and overlap pair of our executor through megatron's combined forward-backward step,
    # the schedule's overlap pairs marked (megatron's --overlap-moe-expert-parallel-comm; runtime/combined_step.py)
    overlap_moe: bool = False
    # Record which forward and backward each of megatron's combined steps ran (verification/combined_steps.py):
    # the result's "combined_steps", per iteration. NATIVE with overlap_moe and several chunks per rank is
    # megatron's own interleaved combined 1F1B, which an overlapped run of its order must match step for step.
    record_combined_steps: bool = False
    distributed_optimizer: bool = False  # megatron's DistributedOptimizer (reduce-scatter + param all-gather)
    # Fully sharded data parallelism per chunk (runtime/fsdp.py) instead of megatron DDP: the executor
    # gathers and frees each chunk's parameters where the collectives pass places it, at most
    # ``fsdp_max_unsharded`` chunks gathered at once.
    fsdp: bool = False
    fsdp_max_unsharded: int = 1
    fsdp_grad_reduce_unit: int | None = (
        None  # FSDP: reduce gradients once per this many micro-batches (None: per iteration)
    )
    check_messages: bool = False  # --pipeline-check-messages: a header with every message, checked on arrival
    # Mode AB with interleaving: run megatron's interleaved schedule with overlap_p2p_comm (and batch_p2p_comm
    # off), as Megatron-LM requires at PP=2 (with batched p2p megatron swaps the two messages to the one peer).
    megatron_overlap_p2p: bool = False
    # megatron-core's optimizer (get_megatron_optimizer: Adam, clipping at clip_grad, loss scaling with found-inf
    # skip when loss_scale is set) instead of torch's Adam; post_validation wraps it (runtime/post_validation.py).
    megatron_optimizer: bool = False
    clip_grad: float = 0.0
    loss_scale: float | None = None
    post_validation: bool = False
    # False: validate before the next iteration's forward-backward; True: after it, before the next step
    # (the next iteration runs on the eagerly stepped weights and is run again when validation changed them)
    post_validation_late: bool = False
    keep_weights: bool = False  # report every parameter after the last step
    # The exact reference of the verdict (verification/criterion.py): the model, its gradients and
    # the optimizer in float64, megatron's cross-entropy too.
    float64: bool = False
    adam_eps: float = 1e-8  # Adam's epsilon (torch's and megatron's optimizer); verification raises it
    # "cpu": megatron's CPU shims (forced even where CUDA exists). "cuda": every rank's model and data on GPU 0
    # (ranks share it), p2p over gloo staged through host memory (host_staging.py); results come back on CPU.
    device: str = "cpu"
    hooks: RunHooks = RunHooks()  # testing aids (all off in a verify run)

    @property
    def world_size(self) -> int:
        return self.pp * self.tp * self.dp
