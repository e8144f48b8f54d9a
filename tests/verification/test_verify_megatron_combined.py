"""Our overlapped runs against megatron-core's OWN interleaved combined 1F1B, on real gloo ranks.

EP = 2 x PP = 2 (4 ranks), the tiny MoE GPT with four layers. megatron's interleaved 1F1B with
``overlap_moe_expert_parallel_comm`` runs every step as a combined forward-backward step, with one extra
warm-up micro-batch per rank; our executor runs the overlapped order of a schedule
(``analysis/overlap_order.py``) through the same combined step.

* interleaved-1f1b is megatron's own order: ``verify`` runs megatron's interleaved combined 1F1B on the
  same ranks too, and ours must make the same combined steps (which forward with which backward, per
  rank) and give bitwise the same losses and gradients, besides passing the criterion.
* 1f1b (two layers a stage, the same model) pairs other micro-batches, so only the results compare: every
  micro-batch loss and the summed gradients within ``verify``'s criterion, with megatron's interleaved
  combined 1F1B as the fp32 run beside the exact one (which must itself pass against the references).

At PP = 2 megatron's interleaved schedule runs with unbatched p2p (``overlap_p2p_comm``, Megatron-LM's
setting; ``verification/rank_run.py``): with megatron-core's default ``batch_p2p_comm`` a step that sends
an activation and a gradient to the one peer has them matched to the peer's receives by posting order,
swapped (the last test shows it on two ranks), and both megatron runs, combined or not, go wrong.
"""

from __future__ import annotations

import dataclasses

from megatron_pp_ext.schedules import generate
from megatron_pp_ext.verification import criterion
from megatron_pp_ext.verification.compare import compare
from megatron_pp_ext.verification.rank_pool import check_errors
from megatron_pp_ext.verification.rank_setup import rank_process_group
from megatron_pp_ext.verification.reference import reference_runs
from megatron_pp_ext.verification.run_spec import NATIVE, OURS, RunSpec
from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec
from megatron_pp_ext.verification.verify import verify_schedule

P, M, DP, EP = 2, 4, 2, 2
MODEL = TinyGPTSpec(num_layers=4, num_experts=4, moe_topk=2)  # one layer a stage of interleaved-1f1b (v = 2)


def test_overlapped_interleaved_makes_megatrons_combined_steps(pool) -> None:
    schedule = generate("interleaved-1f1b", P, M)
    report = verify_schedule(schedule, pool, model=MODEL, dp=DP, ep=EP, overlap_moe=True, iterations=1)
    assert report.problems == []
    assert report.bitwise_megatron_combined is True
    assert report.ok, report.describe()


def _megatron_combined(pool, spec: RunSpec) -> list[dict]:
    """megatron's interleaved combined 1F1B (v = 2) on ``spec``'s ranks, model and data."""
    interleaved = generate("interleaved-1f1b", P, M)
    run = pool.run(
        dataclasses.replace(spec, mode=NATIVE, schedule_csv=interleaved.to_csv(), record_combined_steps=True)
    )
    check_errors(run)
    return run


def test_overlapped_1f1b_matches_megatrons_combined_1f1b(pool) -> None:
    schedule = generate("1f1b", P, M)
    ours = RunSpec(
        pp=P,
        num_microbatches=M,
        dp=DP,
        ep=EP,
        overlap_moe=True,
        mode=OURS,
        schedule_csv=schedule.to_csv(),
        model=MODEL,
        iterations=1,
        adam_eps=criterion.ADAM_EPS,
        lr=criterion.LR,
    )
    exact, ref = reference_runs(pool, ours)
    megatron = _megatron_combined(pool, ours)
    steps = [s for r in megatron for s in r["combined_steps"][0]]
    assert any(f is not None and b is not None for f, b in steps)  # megatron paired forwards with backwards
    theirs = compare("interleaved-1f1b", P, M, 2, ref, megatron, exact=exact)
    assert theirs.ok, theirs.describe()  # megatron's combined 1F1B itself is right
    run = pool.run(ours)
    check_errors(run)
    report = compare("1f1b", P, M, 1, megatron, run, exact=exact)
    assert report.problems == []
    assert report.ok, report.describe()


def exchange_through_megatron(batched: bool, rank: int, init_method: str) -> dict[str, float]:
    """Rank job: PP = 2, both ranks call megatron's ``send_forward_backward_recv_forward_backward`` with an
    activation (``100 + rank``) for the next stage and a gradient (``200 + rank``) for the previous one,
    which at PP = 2 are the same peer; what arrived in each receive buffer."""
    with rank_process_group(rank, 2, init_method, timeout_s=60, tp=1, pp=2, device="cpu"):
        import torch
        from megatron.core import parallel_state as ps
        from megatron.core.model_parallel_config import ModelParallelConfig
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        config = ModelParallelConfig(
            pipeline_model_parallel_size=2,
            pipeline_dtype=torch.float32,
            batch_p2p_comm=batched,
            overlap_p2p_comm=not batched,
        )
        comm = P2PCommunicator(ps.get_pipeline_model_parallel_group(), config)
        activation, gradient = torch.full((2,), 100.0 + rank), torch.full((2,), 200.0 + rank)
        received_activation, received_gradient = comm.send_forward_backward_recv_forward_backward(
            activation, gradient, recv_prev=True, recv_next=True, tensor_shape=(2,)
        )
        return {"activation": float(received_activation[0]), "gradient": float(received_gradient[0])}


def test_megatrons_batched_p2p_swaps_the_two_messages_to_one_peer(pool) -> None:
    """Why megatron's runs here use unbatched p2p at PP = 2: batched (megatron-core's default), each rank's
    activation arrives in the peer's gradient buffer and its gradient in the activation buffer."""
    for batched in (True, False):
        results = pool.run_fn(exchange_through_megatron, batched, 2, 120)
        check_errors(results)
        for rank, got in enumerate(results):
            peer = 1 - rank
            want = {"activation": 100.0 + peer, "gradient": 200.0 + peer}
            swapped = {"activation": want["gradient"], "gradient": want["activation"]}
            assert got == (swapped if batched else want), (batched, rank, got)
