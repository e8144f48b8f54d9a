"""Emulated compute on real ranks: the rank side of ``megatron-pp bench --emulate``.

Every compute op of a run (real megatron-core GPTModel chunks, megatron DDP, real tensors through the
executor's point-to-point) is padded with sleep to a given wall time, so the CPU is idle most of the time
and the iteration time shows the runtime's own behaviour (waits, protocol, bookkeeping) rather than how
fast a shared CPU multiplies matrices. That lets p = 4 and p = 8 run on a 2-core machine.

* Our executor is padded through its tracer (:class:`PaddedTracer`): the executor calls ``begin_op`` /
  ``end_op`` around every F, B, W and BW op, and ``end_op`` sleeps until the op has lasted its pad. No
  executor code is involved, so any p2p protocol behind ``make_forward_backward_func`` is measured alike.
* megatron-core's own 1F1B and interleaved 1F1B are padded by swapping ``forward_step`` and
  ``backward_step`` in ``megatron.core.pipeline_parallel.schedules`` for the duration of their call
  (:func:`padded_megatron`): both schedule functions look them up as module globals at every micro-batch.

The tracer also splits each iteration of a rank into compute and the time between ops (what the rank
waited for), which :mod:`.emulate_bench` reports per schedule and rank.
"""

from __future__ import annotations

import collections
import contextlib
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..runtime.trace import Tracer
from ..schedules.ir import Op
from ..verification.rank_setup import rank_process_group
from ..verification.tiny_gpt import TinyGPTSpec
from .emulate_a2a import SPIN_S, sleep_until  # noqa: F401  (SPIN_S: the pads' spin, named here too)

# megatron-core's schedules compared with ours (our schedule name -> what megatron runs)
NATIVE_1F1B = "1f1b"
NATIVE_INTERLEAVED = "interleaved-1f1b"
NATIVE_PEERS = (NATIVE_1F1B, NATIVE_INTERLEAVED)


@dataclass(frozen=True)
class EmulateJob:
    """One schedule's timed run on ``pp`` ranks (picklable; sent to every rank).

    ``pads_s``: per op kind (``"F"``, ``"B"``, ``"W"``, ``"BW"``) the wall time of one op of each
    global stage, seconds. ``native``: also time megatron-core's own schedule for this placement
    (``1f1b`` or ``interleaved-1f1b``), alternating with ours every iteration, padded with
    ``native_pads_s`` = (forward, full backward) seconds per call.

    MoE (``ep`` = 2, the model's MoE layers real, ``pp * ep`` ranks): ``a2a_s`` pads every dispatch and
    combine all-to-all where it runs (:mod:`.emulate_moe`); ``overlap_moe`` runs every op through megatron's
    combined step (megatron's own schedule too, with its ``overlap_moe_expert_parallel_comm``), the ops' own
    compute then padded node by node: ``node_pads_s`` per op kind per global stage (``F``, ``B``, ``BW``) the
    seconds of each padded compute node, ``native_node_pads_s`` (forward, full backward) for megatron's.
    """

    name: str
    pp: int
    num_microbatches: int
    schedule_csv: str
    pads_s: dict[str, tuple[float, ...]]
    model: TinyGPTSpec = field(default_factory=TinyGPTSpec)
    warmup: int = 2
    iterations: int = 5
    native: str | None = None
    native_pads_s: tuple[float, float] = (0.0, 0.0)
    timeout_s: float = 120.0
    ep: int = 1
    a2a_s: float = 0.0
    overlap_moe: bool = False
    node_pads_s: dict[str, tuple[float, ...]] = field(default_factory=dict)
    native_node_pads_s: tuple[float, float] = (0.0, 0.0)

    @property
    def world_size(self) -> int:
        return self.pp * self.ep


class PaddedTracer(Tracer):
    """A :class:`Tracer` whose ops last at least their pad, and that accounts for the time between ops.

    Per iteration (``breakdowns``), in seconds: ``compute`` (ops, padded), ``real_compute`` (the same
    ops before padding), ``wait`` per op kind (from the end of whatever the rank did last to the start
    of the op: the executor waiting for the op's input receive, and for a backward for its output's
    send), ``post`` (inside the p2p post hooks), ``recv_wait`` / ``send_wait`` (up to a protocol event
    that reports a receive or send wait that blocked, where the executor reports them: ``protocol``
    hooks; otherwise those waits count in ``wait``), ``between`` (other time between ops: bookkeeping
    and collective launches), ``drain`` (after the last op until the executor's loop ends: pending sends,
    collectives) and ``span`` (the executor's iteration, first hook to last). ``ops`` holds every op's
    ``(iteration, name, kind, real_s, pad_s, lasted_s, started_s)`` over the whole run (``started_s`` on
    ``time.perf_counter``'s clock, which every process of the machine shares: ranks line up).
    """

    def __init__(
        self,
        rank: int,
        pads_s: dict[str, tuple[float, ...]],
        param_storages: set[int] | None = None,
        node_pads: tuple[Any, dict[str, tuple[float, ...]]] | None = None,
    ):
        super().__init__(rank, param_storages)
        self.pads_s = pads_s
        # the overlapped run: (NodePads, per kind per stage the node pad) set at every op (emulate_moe.py)
        self.node_pads = node_pads
        self._open: list[Op] = []  # ops begun and not ended: two inside an overlapped pair
        self._pair_ended: list[Op] = []  # the pair's op that ended first
        self.breakdowns: list[dict[str, Any]] = []
        self.ops: list[tuple[int, str, str, float, float, float, float]] = []
        self._cursor = 0.0
        self._op_started = 0.0
        self._comm_started = 0.0
        self._current: dict[str, Any] = {}

    def begin_iteration(self, forward_only: bool = False) -> None:
        super().begin_iteration(forward_only)
        now = time.perf_counter()
        self._cursor = now
        self._current = {
            "begin": now,
            "compute": 0.0,
            "real_compute": 0.0,
            "wait": {},
            "post": 0.0,
            "recv_wait": 0.0,
            "send_wait": 0.0,
            "between": 0.0,
            "waits": [],
        }

    def begin_op(self, op: Op) -> None:
        now = time.perf_counter()
        kind = str(op.kind)
        if self.node_pads is not None and kind in self.node_pads[1]:
            pads, per_kind = self.node_pads
            pads.current["F" if kind == "F" else "B"] = per_kind[kind][op.stage]
        if not self._open:  # the second op of a pair starts with the first
            gap = now - self._cursor
            self._current["wait"][kind] = self._current["wait"].get(kind, 0.0) + gap
            self._current["waits"].append((gap, str(op)))
            self._op_started = now  # the op's share starts where the wait ends: the parts add up to the span
        self._open.append(op)
        super().begin_op(op)

    def end_op(self, op: Op) -> None:
        """Pad the op (a pair: both ops together, to the sum of their pads) and account for it; each op of a
        pair is listed with the pair's times."""
        self._open.remove(op)
        super().end_op(op)
        if self._open:  # the pair's first op to end: the other ends the pair
            self._pair_ended = [op]
            return
        ended = [*self._pair_ended, op]
        self._pair_ended = []
        real = time.perf_counter() - self._op_started
        pads = [self.pads_s[str(o.kind)][o.stage] for o in ended]
        if self.node_pads is not None and len(ended) == 2:  # an overlapped pair: its nodes are padded, not the pair
            pads = [0.0, 0.0]
        sleep_until(self._op_started + sum(pads))
        self._cursor = time.perf_counter()
        lasted = self._cursor - self._op_started
        self._current["compute"] += lasted
        self._current["real_compute"] += real
        for o, p in zip(ended, pads, strict=True):
            self.ops.append((len(self.breakdowns), str(o), str(o.kind), real, p, lasted, self._op_started))

    def begin_comm(self) -> None:
        super().begin_comm()
        self._comm_started = time.perf_counter()
        self._current["between"] += self._comm_started - self._cursor

    def end_comm(self) -> None:
        super().end_comm()
        self._cursor = time.perf_counter()
        self._current["post"] += self._cursor - self._comm_started

    def protocol(self, event: str, what: object, **info: Any) -> None:
        """A p2p protocol event (executors that report them): the time up to a blocked receive or send
        wait is that wait."""
        parent = getattr(super(), "protocol", None)
        if parent is not None:
            parent(event, what, **info)
        now = time.perf_counter()
        elapsed = now - self._cursor
        part = {"recv-wait": "recv_wait", "send-done": "send_wait"}.get(event)
        waited = min(float(info.get("waited_s") or 0.0), elapsed) if part else 0.0  # the wait the event reports
        if part:
            self._current[part] += waited
        self._current["between"] += elapsed - waited
        self._cursor = now

    def end_iteration(self) -> None:
        now = time.perf_counter()
        current = self._current
        current["drain"] = now - self._cursor
        current["span"] = now - current.pop("begin")
        current["longest_waits"] = sorted(current.pop("waits"), reverse=True)[:3]
        self.breakdowns.append(current)
        super().end_iteration()


class NativePads:
    """What :func:`padded_megatron` recorded: ``(iteration, kind, real_s, pad_s, lasted_s)`` per call
    (``iteration``: set by the caller before each forward-backward call)."""

    def __init__(self) -> None:
        self.iteration = 0
        self.ops: list[tuple[int, str, float, float, float]] = []


@contextlib.contextmanager
def padded_megatron(pad_forward_s: float, pad_backward_s: float, record: NativePads) -> Iterator[None]:
    """Pad megatron-core's own schedules: while active, every ``forward_step`` lasts at least
    ``pad_forward_s`` and every ``backward_step`` (a full backward, B and W) ``pad_backward_s``.

    ``forward_backward_pipelining_without_interleaving`` and ``..._with_interleaving`` call both through
    the module's globals at every micro-batch (the non-interleaved one binds ``backward_func =
    backward_step`` at its start, inside the patch), so swapping the module attributes pads each of them.
    """
    import megatron.core.pipeline_parallel.schedules as schedules

    forward, backward = schedules.forward_step, schedules.backward_step

    def padded(kind: str, func: Any, pad: float) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            out = func(*args, **kwargs)
            real = time.perf_counter() - started
            sleep_until(started + pad)
            record.ops.append((record.iteration, kind, real, pad, time.perf_counter() - started))
            return out

        return call

    schedules.forward_step = padded("F", forward, pad_forward_s)
    schedules.backward_step = padded("BW", backward, pad_backward_s)
    try:
        yield
    finally:
        schedules.forward_step, schedules.backward_step = forward, backward


# ------------------------------------------------------------------------------------------------
# Rank jobs (RankPool.run_fn)
# ------------------------------------------------------------------------------------------------
def measure_p2p_latency(
    payload: tuple[int, tuple[int, ...], int], rank: int, init_method: str
) -> tuple[float, float] | None:
    """One-way time of one activation-sized fp32 tensor between ranks 0 and 1 over gloo (s: the median and
    the shortest round trip over ``rounds``, halved), ``payload = (world_size, shape, rounds)``; None on the
    other ranks. On a loaded machine the median includes the wake-up delays a run sees too."""
    world_size, shape, rounds = payload
    with rank_process_group(rank, world_size, init_method, timeout_s=60.0) as dist:
        import torch

        tensor = torch.zeros(shape)
        trips: list[float] = []
        for _ in range(rounds + 5):  # 5 unmeasured round trips first
            started = time.perf_counter()
            if rank == 0:
                dist.send(tensor, 1)
                dist.recv(tensor, 1)
            elif rank == 1:
                dist.recv(tensor, 0)
                dist.send(tensor, 0)
            trips.append(time.perf_counter() - started)
        dist.barrier()
        return (statistics.median(trips[5:]) / 2, min(trips[5:]) / 2) if rank == 0 else None


def run_job(job: EmulateJob, rank: int, init_method: str) -> dict[str, Any]:
    """Time ``job`` on this rank: ``warmup + iterations`` iterations of our executor (and of megatron's own
    schedule, alternating which goes first, with ``job.native``), each started after a barrier. Returns the
    per-iteration wall times of the forward-backward call, the tracer's breakdowns and every op's pad."""
    timeout_s = max(30.0, job.timeout_s)
    with rank_process_group(rank, job.world_size, init_method, timeout_s=timeout_s, tp=1, pp=job.pp, ep=job.ep) as dist:
        from megatron.core import parallel_state as ps

        return _run(job, dist, ps)


def _build(job: EmulateJob, ps: Any, schedule: Any) -> tuple[list[Any], Any]:
    """This rank's chunks of the tiny GPT for the schedule's placement, in megatron DDP, and the config."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    from ..runtime.wgrad_hooks import install_wgrad_hooks, uninstall_wgrad_hooks
    from ..verification import tiny_gpt

    # pool workers are reused: the linear layers split their backward only for schedules with W ops
    (install_wgrad_hooks if schedule.splits_backward else uninstall_wgrad_hooks)()
    config = tiny_gpt.make_config(job.model, ep=job.ep)
    config.overlap_moe_expert_parallel_comm = job.overlap_moe  # megatron's own schedule reads it (ours too)
    chunks, _ = tiny_gpt.build_chunks(config, job.model, schedule.placement, ps.get_pipeline_model_parallel_rank())
    ddp_config = DistributedDataParallelConfig()
    chunks = [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=c, disable_bucketing=(i > 0))
        for i, c in enumerate(chunks)
    ]
    config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 else chunks[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    return chunks, config


def _native_func(job: EmulateJob, ps: Any, config: Any, schedule: Any, num_chunks: int) -> Any:
    """megatron-core's own schedule for ``job.native`` (its interleaved 1F1B set up as Megatron-LM does)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if job.native == NATIVE_1F1B:
        return get_forward_backward_func()
    from megatron.core.pipeline_parallel.schedules import forward_backward_pipelining_with_interleaving

    ps.set_virtual_pipeline_model_parallel_world_size(num_chunks)
    config.virtual_pipeline_model_parallel_size = num_chunks
    if job.pp == 2:  # Megatron-LM requires overlap_p2p_comm at PP=2 (batched p2p swaps the two messages)
        config.batch_p2p_comm, config.overlap_p2p_comm = False, True
    config.microbatch_group_size_per_vp_stage = int(schedule.params.get("microbatch_group_size") or job.pp)
    return forward_backward_pipelining_with_interleaving


def _run(job: EmulateJob, dist: Any, ps: Any) -> dict[str, Any]:
    from ..runtime.executor import make_forward_backward_func
    from ..schedules.schedule import Schedule
    from .emulate_moe import NodePads, padded_all_to_alls, padded_nodes

    schedule = Schedule.from_csv(job.schedule_csv)
    placement = schedule.placement
    chunks, config = _build(job, ps, schedule)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    replica_sync = None
    if placement.num_replicas == 2:
        from ..runtime.replica_sync import ReplicaSync, new_replica_group

        replica_sync = ReplicaSync(chunks, new_replica_group(ps.get_pipeline_model_parallel_group()))
    node_pads = NodePads()
    tracer = PaddedTracer(
        pp_rank,
        job.pads_s,
        {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()},
        node_pads=(node_pads, job.node_pads_s) if job.overlap_moe else None,
    )
    ours = make_forward_backward_func(
        lambda m: schedule,
        tracer_factory=lambda r: tracer,
        timeout_s=job.timeout_s,
        replica_sync=replica_sync,
        overlap_moe=job.overlap_moe,
    )
    funcs: list[tuple[str, Any]] = [("ours", ours)]
    native_record = NativePads()
    if job.native is not None:
        native = _native_func(job, ps, config, schedule, len(chunks))

        def padded_native(**kwargs: Any) -> Any:
            node_pads.current = dict(zip(("F", "B"), job.native_node_pads_s, strict=True))
            with padded_megatron(*job.native_pads_s, native_record):
                return native(**kwargs)

        funcs.append(("megatron", padded_native))
    with contextlib.ExitStack() as stack:
        if job.a2a_s > 0:
            stack.enter_context(padded_all_to_alls(job.a2a_s, recorded := []))
        if job.overlap_moe:
            stack.enter_context(padded_nodes(node_pads))
        times, iteration_calls = _iterations(job, dist, chunks, funcs, native_record)
    breakdowns = tracer.breakdowns
    for breakdown, (started, ended) in zip(breakdowns, iteration_calls, strict=True):
        # outside the executor's loop: schedule agreement (first call), megatron's finalize_model_grads
        # (the tied embedding's all-reduce), the replica sync's finish
        breakdown["outside"] = (ended - started) - breakdown["span"]
    return {
        "pp_rank": pp_rank,
        "times": times,
        "breakdowns": breakdowns,
        "ops": tracer.ops,
        "native_ops": native_record.ops,
        "peak_activation_bytes": tracer.peak_bytes,
        # per padded all-to-all: (direction, dispatch | combine, the thread it ran on), counted
        "a2a_threads": sorted(collections.Counter(recorded).items()) if job.a2a_s > 0 else [],
    }


def _iterations(
    job: EmulateJob, dist: Any, chunks: list[Any], funcs: list[tuple[str, Any]], native_record: NativePads
) -> tuple[dict[str, list[float]], list[tuple[float, float]]]:
    """``warmup + iterations`` iterations of each function, alternating which goes first, each started after
    a barrier: per function the wall time of each call, and ours' (start, end) per iteration."""
    from ..verification import tiny_gpt

    times: dict[str, list[float]] = {name: [] for name, _ in funcs}
    iteration_calls: list[tuple[float, float]] = []  # ours: (call start, call end) per iteration
    for iteration in range(job.warmup + job.iterations):
        native_record.iteration = iteration
        order = funcs if iteration % 2 == 0 else funcs[::-1]
        for name, func in order:
            for c in chunks:
                c.zero_grad_buffer()
            batches = tiny_gpt.make_batches(job.model, iteration, job.num_microbatches)
            dist.barrier()  # every rank starts the iteration together: its time is the slowest rank's
            started = time.perf_counter()
            tiny_gpt.run_forward_backward(func, job.model, chunks, batches, chunk_list=name == "ours")
            ended = time.perf_counter()
            times[name].append(ended - started)
            if name == "ours":
                iteration_calls.append((started, ended))
    return times, iteration_calls
