"""The rank job of the Bridge keyword-argument run (``tests/integration/test_bridge_ranks.py``): a tiny GPT on
two pipeline ranks trained one step through the train stand-in and evaluated through the eval stand-in, first
with megatron's own schedule, then with a plugin schedule installed; what each rank saw."""

from __future__ import annotations

import sys
from typing import Any

from . import MIRRORS, load

MICROBATCHES = 4


def _grads(chunk: Any) -> dict[str, Any]:
    out = {}
    for name, param in chunk.named_parameters():
        grad = getattr(param, "main_grad", None)
        grad = param.grad if grad is None else grad
        if grad is not None:
            out[name] = grad.detach().clone()
    return out


def _step(train: Any, evaluation: Any, rank: int) -> tuple[list[float], list[float], dict[str, Any]]:
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_pp_ext.schedules.placement import make_placement
    from megatron_pp_ext.verification import tiny_gpt

    spec = tiny_gpt.TinyGPTSpec(num_layers=4)
    config = tiny_gpt.make_config(spec)
    chunks, _ = tiny_gpt.build_chunks(config, spec, make_placement("loop", 2, 1), rank)  # after install: hooked
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    func, p2p_communicator = train.train(config, None, pg_collection)
    batches = tiny_gpt.make_batches(spec, 0, MICROBATCHES)
    out = train.train_step(
        func, tiny_gpt.forward_step, iter(batches), chunks, MICROBATCHES, spec.seq_length,
        spec.micro_batch_size, p2p_communicator, pg_collection,
    )  # fmt: skip
    losses = [float(d["lm loss"]) for d in out]
    grads = _grads(chunks[0])
    evaluated = evaluation.evaluate(
        tiny_gpt.forward_step, iter(tiny_gpt.make_batches(spec, 1, 2)), chunks, 2, spec.seq_length,
        spec.micro_batch_size, None, p2p_communicator, pg_collection,
    )  # fmt: skip
    return losses, [float(d["lm loss"]) for d in evaluated], grads


def bridge_kwargs_run(schedule: str, rank: int, init_method: str) -> dict[str, Any]:
    """Megatron's 1F1B, then ``schedule`` installed, through Bridge's calls; losses and gradient differences."""
    from megatron_pp_ext.integration import install as inst
    from megatron_pp_ext.integration.config import PipelineConfig
    from megatron_pp_ext.verification.rank_setup import rank_process_group

    with rank_process_group(rank, 2, init_method, timeout_s=60, pp=2):
        train, evaluation = load("train.py"), load("eval.py")
        try:
            ref_losses, ref_eval, ref_grads = _step(train, evaluation, rank)
            func = inst.install(PipelineConfig(schedule=schedule, pipeline_parallel_size=2, num_layers=4))
            assert train.get_forward_backward_func(pp_size=2, vp_size=None) is func
            losses, evaluated, grads = _step(train, evaluation, rank)
        finally:
            inst.uninstall()
            for name in MIRRORS.values():
                sys.modules.pop(name, None)
    diff = max(float((grads[n] - g).abs().max()) for n, g in ref_grads.items())
    return {
        "rank": rank,
        "ref_losses": ref_losses,
        "losses": losses,
        "ref_eval": ref_eval,
        "eval": evaluated,
        "grad_names": sorted(grads) == sorted(ref_grads) and len(grads) > 0,
        "grad_diff": diff,
    }
