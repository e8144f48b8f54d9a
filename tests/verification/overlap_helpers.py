"""Rank function that gives every model chunk a recording overlap hook, for the overlap-hook tests."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def run_with_chunks_patched(spec: Any, rank: int, init_method: str, patch: Callable[[list[Any]], None]) -> dict:
    """:func:`~megatron_pp_ext.verification.rank_run.run_on_rank` with ``patch(chunks)`` called on every rank's
    chunks once they are built."""
    from megatron_pp_ext.verification import tiny_gpt
    from megatron_pp_ext.verification.rank_run import run_on_rank

    original = tiny_gpt.build_chunks

    def build_chunks(*args: Any, **kwargs: Any) -> Any:
        chunks, layouts = original(*args, **kwargs)
        patch(chunks)
        return chunks, layouts

    tiny_gpt.build_chunks = build_chunks
    try:
        return run_on_rank(spec, rank, init_method)
    finally:
        tiny_gpt.build_chunks = original


def run_with_recording_hook(spec: Any, rank: int, init_method: str) -> dict[str, Any]:
    """:func:`~megatron_pp_ext.verification.rank_run.run_on_rank` where each chunk's overlap hook records its
    calls and runs the pair backward first (a hook may order the two ops as it likes)."""
    from megatron_pp_ext.runtime.overlap import HOOK_ATTRIBUTE, OverlapStep

    calls: list[tuple[str, str, int, int]] = []

    def patch(chunks: list[Any]) -> None:
        for index, chunk in enumerate(chunks):

            def hook(forward: OverlapStep, backward: OverlapStep, index: int = index, chunk: Any = chunk) -> None:
                owner = next(
                    i for i, c in enumerate(chunks) if c is forward.model or getattr(forward.model, "module", None) is c
                )
                calls.append((str(forward.op), str(backward.op), index, owner))
                backward.run()
                forward.run()

            setattr(chunk, HOOK_ATTRIBUTE, hook)

    result = run_with_chunks_patched(spec, rank, init_method, patch)
    result["overlap_calls"] = calls
    return result


def run_with_moe_overlap(spec: Any, rank: int, init_method: str) -> dict[str, Any]:
    """:func:`~megatron_pp_ext.verification.rank_run.run_on_rank` with a
    :class:`~megatron_pp_ext.runtime.moe_overlap.MoEOverlapHook` on every chunk; adds each chunk's events."""
    from megatron_pp_ext.runtime.moe_overlap import install_moe_overlap

    hooks: list[Any] = []
    result = run_with_chunks_patched(spec, rank, init_method, lambda chunks: hooks.extend(install_moe_overlap(chunks)))
    result["moe_overlap_events"] = [hook.events for hook in hooks]
    return result


def run_with_node_events(spec: Any, rank: int, init_method: str) -> dict[str, Any]:
    """:func:`~megatron_pp_ext.verification.rank_run.run_on_rank` recording, in the host's order, megatron's
    combined steps (``("step", forward side?, backward side?)``) and the schedule-plan node events of CPU
    mode's communication stream (:mod:`megatron_pp_ext.integration.cpu_streams`), and counting the
    weight-gradient closures queued per ``"chunk.micro-batch"``."""
    from megatron.core.pipeline_parallel import combined_1f1b

    from megatron_pp_ext.integration import cpu_streams
    from megatron_pp_ext.runtime.wgrad import WeightGradStore
    from megatron_pp_ext.verification.rank_run import run_on_rank

    events: list[tuple[Any, ...]] = []
    original = combined_1f1b.combined_forward_backward_step
    put = WeightGradStore.put
    queued: dict[str, int] = {}

    def counting_put(self: Any, closure: Any, held_bytes: int = 0) -> None:
        key = f"{self._active[0]}.{self._active[1]}"  # (chunk, micro-batch) of the B deferring
        queued[key] = queued.get(key, 0) + 1
        put(self, closure, held_bytes)

    def step(*args: Any, **kwargs: Any) -> Any:
        events.append(("step", args[2] is not None, args[6] is not None))  # f_model, b_model
        return original(*args, **kwargs)

    combined_1f1b.combined_forward_backward_step = step
    WeightGradStore.put = counting_put  # type: ignore[method-assign]
    cpu_streams.EVENTS = events
    try:
        result = run_on_rank(spec, rank, init_method)
    finally:
        combined_1f1b.combined_forward_backward_step = original
        WeightGradStore.put = put  # type: ignore[method-assign]
        cpu_streams.EVENTS = None
    result["node_events"] = events
    result["wgrad_queued"] = queued  # weight-gradient closures each B queued for its W
    return result


def run_with_node_and_send_events(spec: Any, rank: int, init_method: str) -> dict[str, Any]:
    """:func:`run_with_node_events` that also records, among the node events, every pipeline send the
    executor posts: ``("send", kind, source stage, micro-batch)``."""
    from megatron_pp_ext.integration import cpu_streams
    from megatron_pp_ext.runtime.channels import Channels

    post = Channels.post

    def recording_post(self: Any, sends: Any, recvs: Any, where: object) -> None:
        if cpu_streams.EVENTS is not None:
            cpu_streams.EVENTS.extend(("send", m.kind, m.src_stage, m.microbatch) for m, _, _ in sends)
        post(self, sends, recvs, where)

    Channels.post = recording_post  # type: ignore[method-assign]
    try:
        return run_with_node_events(spec, rank, init_method)
    finally:
        Channels.post = post  # type: ignore[method-assign]
