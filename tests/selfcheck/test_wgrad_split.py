"""The B/W split: layer-level bitwise checks and real pipeline runs of split schedules."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_pp_ext.runtime.wgrad import WeightGradError, WeightGradStore
from megatron_pp_ext.schedules import Schedule
from megatron_pp_ext.selfcheck.split_check import LinearCase, linear_deferral_probe, linear_split_check
from megatron_pp_ext.verification.rank_pool import VerifyRunError, check_errors
from megatron_pp_ext.verification.run_spec import RunSpec
from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec
from megatron_pp_ext.verification.verify import verify_schedule

DATA = Path(__file__).parents[1] / "runtime" / "data"  # shared with tests/runtime/test_grad_check.py

LAYER_CASES = [
    LinearCase("column", tp=1, bias=True),
    LinearCase("column", tp=1, bias=False),
    LinearCase("row", tp=1, bias=True),
    LinearCase("output", tp=1),
    LinearCase("column", tp=2, bias=True),
    LinearCase("row", tp=2, bias=False),
    LinearCase("row", tp=2, bias=True),
    LinearCase("output", tp=2),
    LinearCase("column", tp=2, sequence_parallel=True, bias=True),
    LinearCase("column", tp=2, sequence_parallel=True, bias=False),
    LinearCase("row", tp=2, sequence_parallel=True, bias=True),
    LinearCase("output", tp=2, sequence_parallel=True),
    LinearCase("router", tp=1, bias=True),
    LinearCase("router", tp=1, bias=False),
]


@pytest.mark.parametrize(
    "case", LAYER_CASES, ids=lambda c: f"{c.layer}-tp{c.tp}-sp{int(c.sequence_parallel)}-bias{int(c.bias)}"
)
def test_b_now_w_later_is_bitwise_the_fused_backward(pool, case):
    results = pool.run_fn(linear_split_check, case, case.tp, 180)
    check_errors(results)
    for result in results:
        assert result["mismatched"] == [], result
        assert any(name.startswith("x") for name in result["checked"])
        assert ("weight" in result["checked"]) or ("external_weight" in result["checked"])


PROBE_CASES = [
    LinearCase("column", tp=1, bias=True),
    LinearCase("row", tp=2, bias=True),
    LinearCase("column", tp=2, sequence_parallel=True, bias=True),
    LinearCase("output", tp=2),
    LinearCase("router", tp=1, bias=True),
]


@pytest.mark.parametrize(
    "case", PROBE_CASES, ids=lambda c: f"{c.layer}-tp{c.tp}-sp{int(c.sequence_parallel)}-bias{int(c.bias)}"
)
def test_b_defers_every_weight_gradient_and_each_w_computes_them(pool, case):
    """Fails if B falls back to the fused backward (computes a weight gradient) or a W computes nothing."""
    results = pool.run_fn(linear_deferral_probe, case, case.tp, 180)
    check_errors(results)
    # RowParallelLinear adds its bias after the reduction, outside the linear's autograd function: autograd
    # computes that bias gradient in B (wgrad_hooks.py lists it among the gradients that stay in B).
    in_b = ["bias"] if case.layer == "row" and case.bias else []
    for result in results:
        deferred = [n for n in result["params"] if n not in in_b]
        expected = ["external_weight"] if case.layer == "output" else (["bias", "weight"] if case.bias else ["weight"])
        assert result["params"] == expected, result
        assert result["changed_by_b"] == in_b, f"B computed deferred weight gradients: {result}"
        assert result["queued_per_b"] == 1, result  # one closure per linear per B
        assert result["changed_by_w0"] == deferred, f"W0 missed some: {result}"
        assert result["changed_by_w1"] == deferred, f"W1 missed some: {result}"


@pytest.mark.parametrize("csv", ["1f1b_split_p2_m4.csv", "1f1b_split_p4_m6.csv"])
def test_split_schedule_verifies(pool, csv):
    schedule = Schedule.load(DATA / csv)
    report = verify_schedule(schedule, pool, iterations=3)
    assert report.problems == []
    assert report.ok, report


def test_missing_w_fails_naming_chunk_and_microbatch(pool):
    text = (DATA / "1f1b_split_p2_m4.csv").read_text().replace(",W1.2,", ",")  # rank 1 never runs W1.2
    spec = RunSpec(
        pp=2, num_microbatches=4, schedule_csv=text, model=TinyGPTSpec(num_layers=2), iterations=1, split_backward=True
    )
    results = pool.run(spec)
    with pytest.raises(VerifyRunError) as info:
        check_errors(results)
    message = str(info.value)
    assert "pipeline rank 1" in message
    assert "chunk 0 micro-batch 2" in message
    assert "no W op" in message


def test_store_rules_without_torch_work():
    store = WeightGradStore()
    calls = []
    with pytest.raises(WeightGradError, match="hooks are not installed"):
        with store.deferring(0, 0, enabled=True, where="here"):
            pass
    store.hooks_installed = True
    with store.deferring(1, 3, enabled=True, where="here"):
        store.put(lambda: calls.append("w13"), held_bytes=10)
    assert store.pending() == [(1, 3)]
    with pytest.raises(WeightGradError, match="chunk 0 micro-batch 0 has no deferred B"):
        store.run(0, 0, "here")
    store.run(1, 3, "here")
    assert calls == ["w13"]
    store.check_empty("here")
    with store.deferring(0, 1, enabled=True, where="here"):
        store.put(lambda: None)
    with pytest.raises(WeightGradError, match="chunk 0 micro-batch 1"):
        store.check_empty("end of iteration")
    store.check_empty("queue was cleared")
