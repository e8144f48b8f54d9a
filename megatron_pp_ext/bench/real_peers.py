"""One schedule on real gloo ranks, ours against torch.distributed.pipelining's runtime, on the same chunks.

Each rank builds its megatron-core chunks for our schedule's placement (:func:`tiny_gpt.build_chunks`: the
same seeded weights for everyone), wraps them in torch ``PipelineStage`` s (:mod:`.torch_pipelining`) and runs,
every iteration, torch's schedule and ours on the same micro-batches, alternating which goes first; both are
timed, both losses kept. Our 1f1b, the baseline of every gain, runs in the same rotation on chunks of its own
placement (same weights), so a schedule's measured gain over it is a ratio of iterations run seconds apart:
on a machine whose speed drifts by several percent between minutes, gains taken from separate runs would hold
that drift. A torch schedule that refuses the shape (its constructor or its first step raises) is
recorded with its refusal text and our schedule still runs. Then a few traced iterations of ours and of the
baseline, alternating (after one traced warm-up each, left out), give the op
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

OURS, TORCH, BASELINE = "ours", "torch", "baseline"
#: the schedule every gain is measured against
BASELINE_SCHEDULE = "1f1b"


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


class _Ours:
    """One of our schedules on this rank: its chunks (the same seeded weights in every placement) and its
    forward-backward function."""

    def __init__(self, spec: PeerRunSpec, rank: int, schedule: Any) -> None:
        from ..runtime.executor import make_forward_backward_func
        from ..verification import tiny_gpt

        self.spec, self.schedule = spec, schedule
        self.chunks, self.layouts = tiny_gpt.build_chunks(
            tiny_gpt.make_config(spec.model), spec.model, schedule.placement, rank
        )
        self.func = make_forward_backward_func(lambda m: schedule, timeout_s=spec.timeout_s)

    def zero(self) -> None:
        for c in self.chunks:
            c.zero_grad(set_to_none=True)

    def step(self, iteration: int, func: Any = None) -> list[float]:
        """One iteration on micro-batches ``iteration`` (``func``: a traced function of the same schedule)."""
        from ..verification import tiny_gpt

        batches = tiny_gpt.make_batches(self.spec.model, iteration, self.spec.num_microbatches)
        return tiny_gpt.run_forward_backward(func or self.func, self.spec.model, self.chunks, batches, chunk_list=True)


class _PeerRun:
    """Both runtimes (and our baseline) on this rank's chunks: timed iterations, then the traced ones."""

    def __init__(self, spec: PeerRunSpec, rank: int, schedule: Any) -> None:
        self.spec, self.rank, self.schedule = spec, rank, schedule
        self.ours = _Ours(spec, rank, schedule)
        self.chunks, self.layouts = self.ours.chunks, self.ours.layouts
        self.baseline: _Ours | None = None
        if spec.schedule != BASELINE_SCHEDULE:
            base_spec = PeerRunSpec(BASELINE_SCHEDULE, spec.pp, spec.num_microbatches, spec.model)
            self.baseline = _Ours(spec, rank, generate_ours(base_spec))
        self.has_first = any(layout.pre_process for layout in self.layouts)
        self.has_last = any(layout.post_process for layout in self.layouts)
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

    def _torch(self, iteration: int) -> list[float]:
        from .torch_pipelining import torch_step

        spec = self.spec
        return torch_step(self.theirs, spec.model, iteration, spec.num_microbatches, self.has_first, self.has_last)

    def _step(self, name: str, iteration: int) -> list[float]:
        if name == TORCH:
            self.ours.zero()
            return self._torch(iteration)
        runner = self.ours if name == OURS else self.baseline
        assert runner is not None
        runner.zero()
        return runner.step(iteration)

    def result(self) -> dict[str, Any]:
        names = [TORCH, OURS] + ([BASELINE] if self.baseline is not None else [])
        times: dict[str, list[float]] = {name: [] for name in names}
        losses: dict[str, list[list[float]]] = {name: [] for name in names}
        for iteration in range(self.spec.iterations):
            turn = iteration % len(names)  # every runtime takes every place in the rotation in turn
            for name in names[turn:] + names[:turn]:
                if name == TORCH and self.theirs is None:
                    continue
                started = time.perf_counter()
                try:
                    losses[name].append(self._step(name, iteration))
                except Exception as error:
                    if name != TORCH:
                        raise
                    self.refusal, self.theirs = f"{type(error).__name__}: {error}", None  # refused at its step
                    continue
                times[name].append(time.perf_counter() - started)
        traces = self._trace_ours()
        return {
            "rank": self.rank,
            "step_times": times,
            "losses": losses,
            "refusal": self.refusal,
            "ours_trace": traces[0],
            "baseline_trace": traces[1] if len(traces) > 1 else None,
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

    def _trace_ours(self) -> list[dict[str, Any]]:
        """Ours (and the baseline, alternating with it): op times per stage (medians) and the host split of a few
        traced iterations, with the model's own forward time per F of ours (the rest of an F is megatron's
        forward-step wrapper)."""
        from ..runtime.executor import make_forward_backward_func
        from ..runtime.trace import Tracer

        runners = [self.ours] + ([self.baseline] if self.baseline is not None else [])
        tracers = [Tracer(self.rank, track_memory=False) for _ in runners]  # op times without the saved-tensor hook
        funcs = [
            make_forward_backward_func(
                lambda m, s=runner.schedule: s, tracer_factory=lambda r, t=tracer: t, timeout_s=self.spec.timeout_s
            )
            for runner, tracer in zip(runners, tracers, strict=True)
        ]
        first = self.spec.iterations
        for runner, func, tracer in zip(runners, funcs, tracers, strict=True):
            runner.zero()
            runner.step(first, func)  # the traced function's first call: not a steady iteration
            tracer.restart()
        model_forward: dict[int, list[float]] = {}
        with _TimedForwards(self.chunks, [layout.stage for layout in self.layouts], model_forward):
            for iteration in range(self.spec.trace_iterations):
                order = list(range(len(runners)))
                for index in order if iteration % 2 == 0 else order[::-1]:
                    runners[index].zero()
                    runners[index].step(first + 1 + iteration, funcs[index])
        forward = {stage: statistics.median(times) for stage, times in model_forward.items()}
        out = []
        for index, tracer in enumerate(tracers):
            summary = tracer.summary()
            out.append(
                {
                    "op_times_s": _median_op_times(tracer.events),
                    "host": summary["host_parts"],
                    "model_forward_s": forward if index == 0 else {},
                    "step_times_s": [it["step_time_s"] for it in tracer.iterations],
                }
            )
        return out

    def _time_torch_ops(self) -> dict[str, dict[int, float]]:
        """Mean time per stage of torch's forward, fused backward (BW), input backward (B) and weight backward
        (W) over one iteration of its schedule, read by timing its stage methods."""
        spent: dict[tuple[str, int], list[float]] = defaultdict(list)
        for stage in self.stages:
            _time_methods(stage, spent)
        self.ours.zero()
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
