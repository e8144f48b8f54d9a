"""Our executor called exactly as Megatron-Bridge 0.6.2 calls a schedule (its train and eval stand-ins,
``bridge_standin/``, with Bridge's keyword arguments: ``p2p_communicator``, ``pg_collection``,
``adjust_tensor_shapes_fn=None``, ...) on two gloo ranks: the same losses and gradients as megatron's 1F1B
called the same way."""

from __future__ import annotations

import pytest

from megatron_pp_ext.verification.rank_pool import check_errors
from megatron_pp_ext.verification.rank_run import TrainingRankPool
from tests.integration.bridge_standin.ranks import MICROBATCHES, bridge_kwargs_run


@pytest.mark.gloo
@pytest.mark.parametrize("schedule", ["1f1b", "zb-h1"])
def test_bridge_calls_run_the_installed_schedule(pool: TrainingRankPool, schedule: str) -> None:
    results = pool.run_fn(bridge_kwargs_run, schedule, 2, 240)
    check_errors(results)
    last = next(r for r in results if r["rank"] == 1)  # the loss lives on the last pipeline rank
    assert len(last["losses"]) == MICROBATCHES and len(last["eval"]) == 2
    assert last["losses"] == pytest.approx(last["ref_losses"], rel=1e-6)
    assert last["eval"] == pytest.approx(last["ref_eval"], rel=1e-6)
    for r in results:
        assert r["grad_names"], r
        assert r["grad_diff"] <= 1e-6, r
