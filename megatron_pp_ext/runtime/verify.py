"""``megatron-pp verify``: run a schedule on real gloo ranks and compare with a reference.

A run spawns ranks on this machine (a :class:`RankPool`, reusable across runs),
builds a tiny GPTModel split by the schedule's placement, trains a few
iterations with Adam and records every loss and every parameter gradient. The
reference is the same model, unpartitioned (pipeline size 1, same tensor
parallel size), trained by megatron-core's own no-pipelining schedule with the
same seed and data. The report gives the largest relative gradient difference
and absolute loss difference over all iterations.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import queue
import socket
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from .tiny_gpt import TinyGPTSpec

NATIVE = "native"  # megatron-core's own forward_backward_func
OURS = "ours"  # megatron_pp_ext's executor
AB = "ab"  # timing: each iteration runs megatron's function and ours, in alternating order


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
    # Testing aid: a different schedule for some pipeline ranks (to provoke a mismatch).
    schedule_csv_overrides: tuple[tuple[int, str], ...] = ()
    check_messages: bool = False  # --pipeline-check-messages: a header with every message, checked on arrival
    check_agreement: bool = True  # testing aid: False skips the start-of-run schedule agreement
    # Testing aid: a different schedule for some pipeline ranks from the re-plan on (to provoke a mismatch there).
    replan_overrides: tuple[tuple[int, str], ...] = ()

    @property
    def world_size(self) -> int:
        return self.pp * self.tp


# ------------------------------------------------------------------------------------------------
# What runs on one rank
# ------------------------------------------------------------------------------------------------
def run_on_rank(spec: RunSpec, rank: int, init_method: str) -> dict[str, Any]:
    from megatron_pp_ext.megatron.cpu import enable_cpu_mode

    enable_cpu_mode()
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from . import agreement, p2p

    p2p.set_check_messages(spec.check_messages)  # pool workers are reused: set it every run
    agreement.set_enabled(spec.check_agreement)

    dist.init_process_group(
        "gloo",
        init_method=init_method,
        rank=rank,
        world_size=spec.world_size,
        timeout=datetime.timedelta(seconds=max(30.0, spec.timeout_s)),
    )
    try:
        ps.initialize_model_parallel(tensor_model_parallel_size=spec.tp, pipeline_model_parallel_size=spec.pp)
        return _train(spec, torch, ps)
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def _train(spec: RunSpec, torch: Any, ps: Any) -> dict[str, Any]:
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from ..schedules.placement import loop_placement
    from ..schedules.schedule import Schedule
    from . import tiny_gpt
    from .executor import make_forward_backward_func
    from .trace import Tracer

    pp_rank = ps.get_pipeline_model_parallel_rank()
    tp_rank = ps.get_tensor_model_parallel_rank()
    csv_text = dict(spec.schedule_csv_overrides).get(pp_rank, spec.schedule_csv)
    schedule = Schedule.from_csv(csv_text) if csv_text else None
    placement = schedule.placement if schedule is not None else loop_placement(spec.pp)
    if spec.split_backward:
        from .wgrad_hooks import install_wgrad_hooks

        install_wgrad_hooks()

    config = tiny_gpt.make_config(spec.model, tp=spec.tp, sequence_parallel=spec.sequence_parallel)
    chunks, layouts = tiny_gpt.build_chunks(config, spec.model, placement, pp_rank)
    if spec.use_ddp:
        ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=False, use_distributed_optimizer=False)
        chunks = [
            DistributedDataParallel(config=config, ddp_config=ddp_config, module=c, disable_bucketing=(i > 0))
            for i, c in enumerate(chunks)
        ]
        config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
        config.finalize_model_grads_func = finalize_model_grads
    params = [p for c in chunks for p in c.parameters()]
    optimizer = torch.optim.Adam(params, lr=spec.lr)

    tracer: Tracer | None = None
    source: Any = None
    if spec.mode == AB:
        assert schedule is not None
        return _ab_timing(spec, chunks, make_forward_backward_func(lambda m: schedule), get_forward_backward_func())
    if spec.mode == OURS:
        param_storages = {p.untyped_storage().data_ptr() for p in params}
        if spec.trace:
            tracer = Tracer(pp_rank, param_storages)
        if spec.profile_iterations > 0:
            source = _replanning_source(spec, placement.num_ranks, pp_rank)
            profiler = source.make_tracer(tracer)
            forward_backward = make_forward_backward_func(
                source, tracer_factory=lambda r: profiler, timeout_s=spec.timeout_s
            )
        else:
            assert schedule is not None, "our executor needs a schedule"
            forward_backward = make_forward_backward_func(
                lambda m: schedule,
                tracer_factory=(lambda r: tracer) if tracer is not None else None,  # type: ignore[arg-type,return-value]
                timeout_s=spec.timeout_s,
                use_tags=spec.p2p_tags,
            )
    else:
        forward_backward = get_forward_backward_func()

    losses: list[list[float]] = []
    grads: list[dict[str, Any]] = []
    step_times: list[float] = []
    schedules_used: list[str] = []
    for iteration in range(spec.iterations):
        for c in chunks:
            if spec.use_ddp:
                c.zero_grad_buffer()
            else:
                c.zero_grad(set_to_none=True)
        batches = tiny_gpt.make_batches(spec.model, iteration, spec.num_microbatches)
        iterators = [iter(batches) for _ in chunks]
        started = time.perf_counter()
        out = forward_backward(
            forward_step_func=tiny_gpt.forward_step,
            data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks if len(chunks) > 1 or spec.mode == OURS else chunks[0],
            num_microbatches=spec.num_microbatches,
            seq_length=spec.model.seq_length,
            micro_batch_size=spec.model.micro_batch_size,
            decoder_seq_length=spec.model.seq_length,
            forward_only=spec.forward_only,
        )
        step_times.append(time.perf_counter() - started)
        if source is not None:
            schedules_used.append(source(spec.num_microbatches).to_csv())
        losses.append([float(d["lm loss"]) for d in out])
        if spec.forward_only:
            continue
        step: dict[str, Any] = {}
        for chunk, layout in zip(chunks, layouts, strict=True):
            for name, p in tiny_gpt._unwrap(chunk).named_parameters():
                g = getattr(p, "main_grad", None) if spec.use_ddp else p.grad
                key = tiny_gpt.global_name(name, layout, spec.model.tied_embeddings)
                step[f"{key}#tp{tp_rank}#stage{layout.stage}"] = g.detach().clone()
                if spec.use_ddp:
                    p.grad = g.detach().clone()
        grads.append(step)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    result: dict[str, Any] = {
        "pp_rank": pp_rank,
        "tp_rank": tp_rank,
        "losses": losses,
        "grads": grads if spec.keep_grads else [],
        "step_times": step_times,
        "schedules_used": schedules_used,
        "measured_costs": None if source is None or source.costs is None else repr(source.costs),
    }
    if tracer is not None:
        result["trace"] = tracer.summary()
    return result


def _ab_timing(spec: RunSpec, chunks: list[Any], ours: Any, native: Any) -> dict[str, Any]:
    """Time megatron's function and ours on the same ranks, model and data, alternating which goes first."""
    from . import tiny_gpt

    times: dict[str, list[float]] = {NATIVE: [], OURS: []}
    losses: dict[str, list[list[float]]] = {NATIVE: [], OURS: []}
    for iteration in range(spec.iterations):
        order = [(NATIVE, native), (OURS, ours)]
        if iteration % 2:
            order.reverse()
        for name, func in order:
            for c in chunks:
                c.zero_grad_buffer()
            batches = tiny_gpt.make_batches(spec.model, iteration, spec.num_microbatches)
            started = time.perf_counter()
            out = func(
                forward_step_func=tiny_gpt.forward_step,
                data_iterator=iter(batches),
                model=chunks if name == OURS else chunks[0],
                num_microbatches=spec.num_microbatches,
                seq_length=spec.model.seq_length,
                micro_batch_size=spec.model.micro_batch_size,
                decoder_seq_length=spec.model.seq_length,
            )
            times[name].append(time.perf_counter() - started)
            losses[name].append([float(d["lm loss"]) for d in out])
    return {"step_times": times, "losses": losses}


def _replanning_source(spec: RunSpec, p: int, pp_rank: int = 0) -> Any:
    from ..analysis.validate import validate
    from ..schedules import registry
    from .replan import ReplanningSource

    assert spec.replan_schedule is not None, "profile_iterations needs replan_schedule"
    name = spec.replan_schedule

    from ..analysis.simulate import Costs

    initial = Costs.parse(spec.replan_initial_costs) if spec.replan_initial_costs else None

    def build(m: int, costs: Any) -> Any:
        this_name = name if costs is None else dict(spec.replan_overrides).get(pp_rank, name)
        costs = costs if costs is not None else initial
        kwargs: dict[str, Any] = {"memory_limit": spec.replan_memory_limit}
        if costs is not None and this_name == name:
            kwargs["costs"] = costs
        schedule = registry.generate(this_name, p, m, **kwargs)
        validate(schedule)
        return schedule

    return ReplanningSource(build, spec.profile_iterations, log=lambda text: None)


# ------------------------------------------------------------------------------------------------
# A pool of rank processes, spawned once
# ------------------------------------------------------------------------------------------------
def _worker(index: int, inbox: Any, outbox: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    while True:
        job = inbox.get()
        if job is None:
            return
        fn, payload, rank, init_method = job
        try:
            outbox.put((index, fn(payload, rank, init_method)))
        except BaseException as exc:  # report every failure to the driver, with the rank
            outbox.put((index, {"error": f"rank {rank}: {type(exc).__name__}: {exc}", "tb": traceback.format_exc()}))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RankPool:
    """``size`` spawned rank processes that run jobs; reuse it across runs.

    When a rank fails, the others get ``grace_s`` seconds to finish (a peer of a
    failed rank is usually stuck in a collective with it); ranks still running
    then are killed and reported as such, and the pool respawns its processes on
    the next run.
    """

    def __init__(self, size: int, grace_s: float = 15.0) -> None:
        self.size = size
        self.grace_s = grace_s
        self.procs: list[Any] = []
        self._spawn()

    def _spawn(self) -> None:
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(self.size)]
        self.procs = [
            ctx.Process(target=_worker, args=(i, self.inboxes[i], self.outbox), daemon=True) for i in range(self.size)
        ]
        for p in self.procs:
            p.start()

    def run(self, spec: RunSpec, wall_timeout_s: float | None = None) -> list[dict[str, Any]]:
        """Run one training run (:func:`run_on_rank`) on ``spec.world_size`` ranks."""
        return self.run_fn(run_on_rank, spec, spec.world_size, wall_timeout_s or (spec.timeout_s * 4 + 120))

    def run_fn(self, fn: Any, payload: Any, world_size: int, wall_timeout_s: float = 300.0) -> list[Any]:
        """Call ``fn(payload, rank, init_method)`` on ranks ``0..world_size-1``; ``fn`` must be importable."""
        if world_size > self.size:
            raise ValueError(f"run needs {world_size} ranks, the pool has {self.size}")
        if not self.procs or not all(p.is_alive() for p in self.procs):
            self.close(kill=True)
            self._spawn()
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        for rank in range(world_size):
            self.inboxes[rank].put((fn, payload, rank, init_method))
        results: dict[int, Any] = {}
        deadline = time.monotonic() + wall_timeout_s
        while len(results) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(results))
                self.close(kill=True)
                if any(isinstance(r, dict) and "error" in r for r in results.values()):
                    for rank in missing:
                        results[rank] = {"error": f"rank {rank}: killed after another rank failed", "tb": ""}
                    break
                raise TimeoutError(f"ranks {missing} did not finish within {wall_timeout_s:g}s; the pool was killed")
            try:
                index, result = self.outbox.get(timeout=min(remaining, 2.0))
            except queue.Empty:
                dead = [i for i in range(world_size) if not self.procs[i].is_alive()]
                if dead:
                    self.close(kill=True)
                    raise RuntimeError(f"rank process(es) {dead} died") from None
                continue
            results[index] = result
            if isinstance(result, dict) and "error" in result:
                deadline = min(deadline, time.monotonic() + self.grace_s)
        return [results[r] for r in range(world_size)]

    def close(self, kill: bool = False) -> None:
        for i, p in enumerate(self.procs):
            if p.is_alive():
                if kill:
                    p.kill()
                else:
                    self.inboxes[i].put(None)
        for p in self.procs:
            p.join(timeout=10)
        self.procs = []

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(kill=exc[0] is not None)


# ------------------------------------------------------------------------------------------------
# Comparison
# ------------------------------------------------------------------------------------------------
class VerifyRunError(RuntimeError):
    """A rank failed while running the schedule."""


@dataclass
class VerifyReport:
    schedule: str
    p: int
    m: int
    v: int
    ok: bool
    max_rel_grad_diff: float
    max_abs_loss_diff: float
    bitwise_equal: bool
    iterations: int
    losses: list[float]
    peak_activation_bytes: list[int] = field(default_factory=list)
    measured_bubble_rate: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    tolerance: float = 1e-6

    def to_json_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_errors(results: list[dict[str, Any]]) -> None:
    errors = [r for r in results if "error" in r]
    if errors:
        first = next((r for r in errors if "killed after" not in r["error"]), errors[0])
        raise VerifyRunError(first["error"] + "\n" + first.get("tb", ""))


def _loss_rank(results: list[dict[str, Any]]) -> dict[str, Any]:
    holders = [r for r in results if r["losses"] and r["losses"][0]]
    if not holders:
        raise VerifyRunError("no rank reported a loss")
    return holders[0]


def compare(
    name: str, p: int, m: int, v: int, ref: list[dict[str, Any]], run: list[dict[str, Any]], tol: float = 1e-6
) -> VerifyReport:
    """Compare a pipeline run with its reference (both already checked for errors)."""
    import torch

    ref_losses = _loss_rank(ref)["losses"]
    run_losses = _loss_rank(run)["losses"]
    problems: list[str] = []
    loss_diff = 0.0
    bitwise = True
    for it, (a, b) in enumerate(zip(run_losses, ref_losses, strict=True)):
        if len(a) != len(b):
            problems.append(f"iteration {it}: {len(a)} losses reported, reference has {len(b)}")
            continue
        for x, y in zip(a, b, strict=True):
            loss_diff = max(loss_diff, abs(x - y))
            bitwise &= x == y
    grad_diff = 0.0
    ref_grads = [
        {f"{k.split('#')[0]}#{k.split('#')[1]}": g for r in ref for k, g in r["grads"][it].items()}
        for it in range(len(ref[0]["grads"]))
    ]
    covered: set[str] = set()
    for r in run:
        for it, step in enumerate(r["grads"]):
            for key, g in step.items():
                name_tp = "#".join(key.split("#")[:2])
                want = ref_grads[it].get(name_tp)
                if want is None:
                    problems.append(f"iteration {it}: parameter {name_tp} has no reference counterpart")
                    continue
                covered.add(name_tp)
                if g.shape != want.shape:
                    problems.append(f"{name_tp}: shape {tuple(g.shape)} vs reference {tuple(want.shape)}")
                    continue
                scale = max(float(want.abs().max()), 1e-30)
                diff = float((g - want).abs().max()) / scale
                bitwise &= bool(torch.equal(g, want))
                if diff > grad_diff:
                    grad_diff = diff
    if ref_grads:
        missing = sorted(set(ref_grads[0]) - covered)
        if missing:
            problems.append(f"parameters never produced a gradient on any rank: {missing[:5]}")
    ok = (
        not problems
        and grad_diff <= tol
        and loss_diff <= tol * max(1.0, abs(ref_losses[0][0]) if ref_losses[0] else 1.0)
    )
    traces = [r.get("trace") for r in sorted(run, key=lambda r: (r["pp_rank"], r["tp_rank"])) if r["tp_rank"] == 0]
    return VerifyReport(
        schedule=name,
        p=p,
        m=m,
        v=v,
        ok=ok,
        max_rel_grad_diff=grad_diff,
        max_abs_loss_diff=loss_diff,
        bitwise_equal=bitwise,
        iterations=len(run_losses),
        losses=[sum(x) / len(x) if x else float("nan") for x in run_losses],
        peak_activation_bytes=[t["peak_activation_bytes"] for t in traces if t],
        measured_bubble_rate=[t["measured_bubble_rate"] for t in traces if t],
        problems=problems,
        tolerance=tol,
    )


def verify_schedule(
    schedule: Any,
    pool: RankPool | None = None,
    *,
    model: TinyGPTSpec | None = None,
    tp: int = 1,
    iterations: int = 3,
    trace: bool = True,
    use_ddp: bool = True,
    sequence_parallel: bool = False,
    timeout_s: float = 60.0,
    tol: float = 1e-6,
    p2p_tags: bool = True,
) -> VerifyReport:
    """Run ``schedule`` (a validated Schedule) and its reference; return the comparison."""
    from ..analysis.validate import validate

    validate(schedule)
    p, m = schedule.num_ranks, schedule.num_microbatches
    if model is None:
        model = TinyGPTSpec(num_layers=schedule.placement.stages_per_replica)
    split = schedule.splits_backward
    common = {
        "num_microbatches": m,
        "tp": tp,
        "model": model,
        "iterations": iterations,
        "use_ddp": use_ddp,
        "sequence_parallel": sequence_parallel,
        "timeout_s": timeout_s,
    }
    own_pool = pool is None
    pool = pool or RankPool(p * tp)
    try:
        ref = pool.run(RunSpec(pp=1, mode=NATIVE, **common))  # type: ignore[arg-type]
        _check_errors(ref)
        run = pool.run(
            RunSpec(
                pp=p,
                mode=OURS,
                schedule_csv=schedule.to_csv(),
                trace=trace,
                split_backward=split,
                p2p_tags=p2p_tags,
                **common,  # type: ignore[arg-type]
            )
        )
        _check_errors(run)
    finally:
        if own_pool:
            pool.close()
    return compare(schedule.name, p, m, schedule.chunks_per_rank, ref, run, tol)
