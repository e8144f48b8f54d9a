"""Forwards and backwards through megatron-core's combined forward-backward step (MoE all-to-all overlap).

With ``--overlap-moe-expert-parallel-comm`` megatron-core runs a forward of one micro-batch and a
backward of another as one step, layer by layer and node by node (attention, token dispatch, experts,
token combine: ``models/common/model_chunk_schedule_plan.py``), so that each side's expert-parallel
all-to-alls run under the other side's compute; on a GPU the dispatch and combine nodes run on a
communication stream. Its entry point, ``pipeline_parallel.combined_1f1b.combined_forward_backward_step``,
takes a forward side and a backward side, either of which may be absent.

:func:`combined_step` runs one such step for the executor: an overlap pair of the schedule
(:mod:`~megatron_pp_ext.schedules.pairs`) as both sides, and as one side a lone ``F`` or ``B``/``BW``
of a micro-batch whose other op (on the same stage) is in a pair: a forward built that way is a
*schedule plan* (the model chunk's ``build_schedule_plan``, asked for by the forward step function with
``return_schedule_plan=True``) whose output tensor carries the plan and the loss node, and only the
combined step can run that plan's backward. A micro-batch neither of whose ops on a stage is paired
runs megatron's plain ``forward_step`` / ``backward_step`` there (the run plan's ``paired``): nothing to
hide its all-to-alls behind, and the schedule plan's node machinery would cost host time for nothing.

The executor keeps everything else: inputs from its mailbox, outputs into it, the saved tensors, the
schedule's order. A ``B`` op (a split schedule) runs inside the weight-gradient store's deferral like
any ``B``: the linears of the paired backward queue their weight gradients for the op's ``W``
(megatron's own ``delay_wgrad_compute`` stays off, so the plan's ``backward_dw`` calls have nothing
to do).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

from ..schedules.ir import Op, OpKind
from ..schedules.lowering import Exchange, Message
from .errors import CommStreamError, ExecutorError
from .grad_check import watching

__all__ = ["combined_pair", "combined_step", "early_sends"]


def combined_step(run: Any, forward: Op | None, backward: Op | None, early_sends: Sequence[Message] = ()) -> None:
    """Run ``forward`` and ``backward`` (either may be None) as one megatron combined step on the
    executor state ``run`` (its ``_forward_inputs`` / ``_forward_outputs`` / ``_backward_inputs`` /
    ``_backward_outputs`` move the tensors). ``early_sends``: the messages that carry the forward's
    output, posted from megatron's ``post_forward`` callback, once the plan has run the forward's last
    layer, instead of after the step."""
    from megatron.core.pipeline_parallel.combined_1f1b import combined_forward_backward_step
    from megatron.core.pipeline_parallel.utils import set_streams

    # the communication stream of the dispatch and combine nodes (created once), as megatron's schedules do
    set_streams(high_priority=getattr(run.config, "high_priority_a2a_comm_stream", False))
    placement = run.placement
    f_input = f_iterator = f_model = f_chunk = None
    if forward is not None:
        f_input, f_iterator = run._forward_inputs(forward)
        f_chunk = placement.chunk_of(forward.stage)
        f_model = run.models[f_chunk]
    b_input = b_output = b_grad = b_model = None
    deferral: Any = contextlib.nullcontext()
    if backward is not None:
        b_input, b_output, b_grad = run._backward_inputs(backward)
        b_chunk = placement.chunk_of(backward.stage)
        b_model = run.models[b_chunk]
        deferral = run.wgrad.deferring(
            b_chunk,
            backward.microbatch,
            enabled=backward.kind == OpKind.B,
            where=run._where(backward),
            model_chunk=b_model,
        )
    saving = run.tracer.saving(forward) if forward is not None else contextlib.nullcontext()
    last = placement.is_last(forward.stage) if forward is not None else False
    sent: list[Any] = []  # the output tensor posted from post_forward
    post_forward = None
    if forward is not None and early_sends:

        def post_forward(f_output: Any, vp_stage: Any) -> None:
            for msg in early_sends:
                run.mailbox[msg.key] = f_output
            run._exchange(Exchange(tuple(early_sends), ()), backward)
            run.sent_early.update(early_sends)
            sent.append(f_output)

    try:
        with deferral, saving, _loss_where_placed(last, run.cp_size):
            output, num_tokens, input_grad = combined_forward_backward_step(
                run.forward_step_func,
                f_iterator,
                f_model,
                run.num_microbatches,
                f_input,
                run.forward_data_store,
                b_model,
                b_input,
                b_output,
                b_grad,
                run.config,
                f_model_chunk_id=f_chunk,
                collect_non_loss_data=run.collect_non_loss_data,
                checkpoint_activations_microbatch=None,
                is_first_microbatch=run._is_first_microbatch(forward) if forward is not None else False,
                current_microbatch=forward.microbatch if forward is not None else None,
                post_forward=post_forward,
            )
    except CommStreamError as exc:  # name this rank and the op(s), as a failed pipeline message does
        ops = "+".join(str(op) for op in (forward, backward) if op is not None)
        raise CommStreamError(f"{run._where()} in combined step {ops}: {exc}") from exc
    if forward is not None:
        if early_sends and (not sent or sent[0] is not output):  # the plan's output is what was sent
            raise ExecutorError(f"{run._where(forward)}: megatron's post_forward did not get the forward's output")
        run._forward_outputs(forward, f_input, output, num_tokens, deposited=bool(sent))
    if backward is not None:
        run._backward_outputs(backward, input_grad)


@contextlib.contextmanager
def _loss_where_placed(is_last_stage: bool, cp_size: int) -> Iterator[None]:
    """megatron's combined step asks ``forward_step_calc_loss`` to find out itself whether the chunk ends
    the model, from megatron's own stage placement; V and bidirectional placements put the last stage
    elsewhere, so the executor tells it (as it tells megatron's ``forward_step``)."""
    from megatron.core.pipeline_parallel import schedules

    original = schedules.forward_step_calc_loss

    def calc_loss(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("cp_group_size", cp_size)
        kwargs.setdefault("is_last_stage", is_last_stage)
        return original(*args, **kwargs)

    schedules.forward_step_calc_loss = calc_loss
    try:
        yield
    finally:
        schedules.forward_step_calc_loss = original


def combined_pair(
    run: Any, first: Op, second: Op, between: Sequence[Exchange], after: Exchange | None, gap: int
) -> None:
    """The overlap pair ``first``+``second`` (op ``gap`` of the rank and the next) as one combined step,
    then what the program does between its two ops (``between``: exchanges; the collectives of the gap
    between them). The lowering has received both inputs before the pair. ``after``: the exchange that
    follows the pair (it sends the second op's output).

    The forward's output is sent from inside the step (:func:`early_sends`); everything else the
    exchanges post keeps its place after the step."""
    forward, backward = (first, second) if first.kind == OpKind.F else (second, first)
    early = early_sends(forward, first, between, after)
    run._await_inputs(first)
    run._await_inputs(second)
    run.tracer.begin_op(first)
    run.tracer.begin_op(second)
    with watching(run.grad_watch, run.placement.chunk_of(backward.stage), backward.microbatch):
        combined_step(run, forward, backward, early)
    run.tracer.end_op(second)
    run.tracer.end_op(first)
    for ins in between:
        run._exchange(ins, second)
    for collective in run.plan.collectives.get(gap + 1, ()):
        run._collective(collective)


def early_sends(forward: Op, first: Op, between: Sequence[Exchange], after: Exchange | None) -> tuple[Message, ...]:
    """The sends of ``forward``'s output that may leave as soon as the forward has run: in program
    order, the pair's sends are those of ``between`` (the first op's output) then those of ``after`` (the
    second's); a send of the forward leaves early unless an earlier send of the pair, which waits for
    the backward, goes to the same rank (sends to one peer keep their program order)."""
    ordered = [(first, m) for ex in between for m in ex.sends]
    if after is not None:
        ordered += [(forward if first is not forward else None, m) for m in after.sends]
    out: list[Message] = []
    held: set[int] = set()  # ranks an earlier, later-posted send goes to
    for op, msg in ordered:
        if op is forward and msg.dst_rank not in held:
            out.append(msg)
        else:
            held.add(msg.dst_rank)
    return tuple(out)
