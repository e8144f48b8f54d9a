"""One schedule on real gloo ranks, ours against torch.distributed.pipelining's runtime, on the same chunks.

Each rank builds its megatron-core chunks for our schedule's placement (:func:`tiny_gpt.build_chunks`: the
same seeded weights for everyone), wraps them in torch ``PipelineStage`` s (:mod:`.torch_pipelining`) and runs,
every iteration, torch's schedule and ours on the same micro-batches, alternating which goes first; both are
timed, both losses kept. A torch schedule that refuses the shape (its constructor or its first step raises) is
recorded with its refusal text and our schedule still runs. Then a few traced iterations of ours (after one
traced warm-up, left out) give the op
times per stage and the host time between ops by named part (:class:`~megatron_pp_ext.runtime.trace.Tracer`),
with the time inside the model's own forward (so the forward-step wrapper's cost shows), and one iteration of
torch's with its stage methods timed gives its F, its split backward (input ``B`` and weight ``W``, torch's
``stage_backward_input`` / ``stage_backward_weight``) or its fused backward per stage.

No data parallelism, no megatron DDP (plain ``.grad`` on both sides), no optimizer step.
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from ..verification.rank_setup import rank_process_group
from ..verification.tiny_gpt import TinyGPTSpec
from .real_peers_cases import LOOP_CHUNKS, TORCH_PEERS, TORCH_SPLIT

OURS, TORCH = "ours", "torch"


@dataclass(frozen=True)
class PeerRunSpec:
    """One schedule, ours and torch's, on ``pp`` ranks (picklable; sent to every rank)."""

    schedule: str  # our registry name, a key of TORCH_PEERS
    pp: int
    num_microbatches: int
    model: TinyGPTSpec
    iterations: int = 6
    trace_iterations: int = 3
    timeout_s: float = 600.0


def generate_ours(spec: PeerRunSpec) -> Any:
    """Our schedule for ``spec`` (with its virtual stages)."""
    from ..schedules import generate

    return generate(spec.schedule, spec.pp, spec.num_microbatches, v=LOOP_CHUNKS.get(spec.schedule))


def is_split(schedule: Any) -> bool:
    """Whether a schedule has separate weight-gradient ops (it needs the weight-gradient hooks)."""
    return any(op.kind.value == "W" for ops in schedule.ops for op in ops)


def run_on_rank(spec: PeerRunSpec, rank: int, init_method: str) -> dict[str, Any]:
    with rank_process_group(rank, spec.pp, init_method, timeout_s=spec.timeout_s, pp=spec.pp):
        schedule = generate_ours(spec)
        if not is_split(schedule):
            return _PeerRun(spec, rank, schedule).result()
        from ..runtime.wgrad_hooks import install_wgrad_hooks, uninstall_wgrad_hooks

        install_wgrad_hooks()
        try:
            return _PeerRun(spec, rank, schedule).result()
        finally:
            uninstall_wgrad_hooks()


class _PeerRun:
    """Both runtimes on this rank's chunks: timed iterations, then the traced ones."""

    def __init__(self, spec: PeerRunSpec, rank: int, schedule: Any) -> None:
        from ..runtime.executor import make_forward_backward_func
        from ..verification import tiny_gpt

        self.spec, self.rank, self.schedule = spec, rank, schedule
        placement = schedule.placement
        self.chunks, self.layouts = tiny_gpt.build_chunks(tiny_gpt.make_config(spec.model), spec.model, placement, rank)
        self.has_first = any(layout.pre_process for layout in self.layouts)
        self.has_last = any(layout.post_process for layout in self.layouts)
        self.ours = make_forward_backward_func(lambda m: schedule, timeout_s=spec.timeout_s)
        self.refusal: str | None = None
        self.theirs: Any = None
        try:
            self.theirs = self._torch_schedule()
        except Exception as error:  # torch refuses the shape: named in the table, never dropped
            self.refusal = f"{type(error).__name__}: {error}"

    def _torch_schedule(self) -> Any:
        from torch.distributed.pipelining import schedules as torch_schedules

        from .torch_pipelining import cross_entropy_loss, torch_stages

        self.stages = torch_stages(self.spec.model, self.chunks, self.layouts, self.schedule.placement)
        cls = getattr(torch_schedules, TORCH_PEERS[self.spec.schedule])
        single = issubclass(cls, torch_schedules.PipelineScheduleSingle)
        stages = self.stages[0] if single and len(self.stages) == 1 else self.stages
        return cls(stages, self.spec.num_microbatches, loss_fn=cross_entropy_loss(self.spec.model.vocab_size))

    def _zero(self) -> None:
        for c in self.chunks:
            c.zero_grad(set_to_none=True)

    def _ours(self, iteration: int, func: Any = None) -> list[float]:
        from ..verification import tiny_gpt

        batches = tiny_gpt.make_batches(self.spec.model, iteration, self.spec.num_microbatches)
        return tiny_gpt.run_forward_backward(func or self.ours, self.spec.model, self.chunks, batches, chunk_list=True)

    def _torch(self, iteration: int) -> list[float]:
        from .torch_pipelining import torch_step

        spec = self.spec
        return torch_step(self.theirs, spec.model, iteration, spec.num_microbatches, self.has_first, self.has_last)

    def result(self) -> dict[str, Any]:
        times: dict[str, list[float]] = {OURS: [], TORCH: []}
        losses: dict[str, list[list[float]]] = {OURS: [], TORCH: []}
        for iteration in range(self.spec.iterations):
            order = [TORCH, OURS] if iteration % 2 == 0 else [OURS, TORCH]
            for name in order:
                if name == TORCH and self.theirs is None:
                    continue
                self._zero()
                started = time.perf_counter()
                try:
                    losses[name].append(self._ours(iteration) if name == OURS else self._torch(iteration))
                except Exception as error:
                    if name == OURS:
                        raise
                    self.refusal, self.theirs = f"{type(error).__name__}: {error}", None  # refused at its step
                    continue
                times[name].append(time.perf_counter() - started)
        return {
            "rank": self.rank,
            "step_times": times,
            "losses": losses,
            "refusal": self.refusal,
            "ours_trace": self._trace_ours(),
            "torch_op_times_s": self._time_torch_ops() if self.theirs is not None else {},
            "torch_plain_step_times": self._torch_on_plain() if self.theirs is not None else [],
        }

    def _torch_on_plain(self) -> list[float]:
        """Step times of torch's split schedule on plain torch layers of the same shapes (its generic split is
        free there), one untimed step first; empty for the schedules that do not split."""
        from torch.distributed.pipelining import schedules as torch_schedules

        from .plain_chunks import plain_stages
        from .torch_pipelining import cross_entropy_loss, torch_step

        name = TORCH_PEERS[self.spec.schedule]
        if name not in TORCH_SPLIT:
            return []
        spec = self.spec
        stages = plain_stages(spec.model, self.layouts, self.schedule.placement.num_stages)
        plain = getattr(torch_schedules, name)(
            stages, spec.num_microbatches, loss_fn=cross_entropy_loss(spec.model.vocab_size)
        )
        times = []
        for iteration in range(spec.iterations):
            for stage in stages:
                stage.submod.zero_grad(set_to_none=True)
            started = time.perf_counter()
            torch_step(plain, spec.model, iteration, spec.num_microbatches, self.has_first, self.has_last)
            times.append(time.perf_counter() - started)
        return times

    def _trace_ours(self) -> dict[str, Any]:
        """Op times per stage (medians) and the host split of a few traced iterations of ours, with the model's own
        forward time per F (the rest of an F is megatron's forward-step wrapper)."""
        from ..runtime.executor import make_forward_backward_func
        from ..runtime.trace import Tracer

        tracer = Tracer(self.rank, track_memory=False)  # op times without the saved-tensor hook
        traced = make_forward_backward_func(
            lambda m: self.schedule, tracer_factory=lambda r: tracer, timeout_s=self.spec.timeout_s
        )
        self._zero()
        self._ours(self.spec.iterations, traced)  # the traced function's first call: not a steady iteration
        tracer.restart()
        model_forward: dict[int, list[float]] = {}
        with _TimedForwards(self.chunks, [layout.stage for layout in self.layouts], model_forward):
            for iteration in range(self.spec.trace_iterations):
                self._zero()
                self._ours(self.spec.iterations + 1 + iteration, traced)
        summary = tracer.summary()
        return {
            "op_times_s": _median_op_times(tracer.events),
            "host": summary["host_parts"],
            "model_forward_s": {stage: statistics.median(times) for stage, times in model_forward.items()},
            "step_times_s": [it["step_time_s"] for it in tracer.iterations],
        }

    def _time_torch_ops(self) -> dict[str, dict[int, float]]:
        """Mean time per stage of torch's forward, fused backward (BW), input backward (B) and weight backward
        (W) over one iteration of its schedule, read by timing its stage methods."""
        spent: dict[tuple[str, int], list[float]] = defaultdict(list)
        for stage in self.stages:
            _time_methods(stage, spent)
        self._zero()
        self._torch(self.spec.iterations + 1 + self.spec.trace_iterations)
        for stage in self.stages:
            for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
                stage.__dict__.pop(name, None)
        out: dict[str, dict[int, float]] = {}
        for (kind, stage_index), values in spent.items():
            out.setdefault(kind, {})[stage_index] = sum(values) / len(values)
        return out


def _median_op_times(events: list[dict[str, Any]]) -> dict[str, dict[int, float]]:
    """Median duration (s) of each op kind per stage over the traced ops (a load spike on a shared machine moves
    a mean, not the median)."""
    durations: dict[tuple[str, int], list[float]] = defaultdict(list)
    for event in events:
        if event["cat"] not in ("comm", "collective"):
            stage = int(event["name"][len(event["cat"]) :].split(".")[0])
            durations[(event["cat"], stage)].append(event["dur"] / 1e6)
    out: dict[str, dict[int, float]] = {}
    for (kind, stage), values in durations.items():
        out.setdefault(kind, {})[stage] = statistics.median(values)
    return out


def _time_methods(stage: Any, spent: dict[tuple[str, int], list[float]]) -> None:
    """Shadow a torch stage's compute methods with timed ones (instance attributes, removed afterwards)."""

    def timed(name: str, kind_of: Any) -> None:
        method = getattr(stage, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            out = method(*args, **kwargs)
            spent[(kind_of(kwargs), stage.stage_index)].append(time.perf_counter() - started)
            return out

        setattr(stage, name, wrapper)

    timed("forward_one_chunk", lambda kw: "F")
    timed("backward_one_chunk", lambda kw: "BW" if kw.get("full_backward", True) else "B")
    timed("backward_weight_one_chunk", lambda kw: "W")


class _TimedForwards:
    """Records, per stage, the time of each forward of the chunk's own model (without megatron's forward-step
    wrapper around it) into ``into`` while active."""

    def __init__(self, chunks: list[Any], stages: list[int], into: dict[int, list[float]]) -> None:
        self.chunks, self.stages, self.into, self.start = chunks, stages, into, 0.0
        self.handles: list[Any] = []

    def __enter__(self) -> None:
        def pre(module: Any, args: Any) -> None:
            self.start = time.perf_counter()

        def post_for(stage: int) -> Any:
            def post(module: Any, args: Any, output: Any) -> None:
                self.into.setdefault(stage, []).append(time.perf_counter() - self.start)

            return post

        for chunk, stage in zip(self.chunks, self.stages, strict=True):
            self.handles += [chunk.register_forward_pre_hook(pre), chunk.register_forward_hook(post_for(stage))]

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
