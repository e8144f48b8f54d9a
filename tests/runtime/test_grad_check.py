"""The runtime guard (runtime/grad_check.py): silent loss of weight gradients must raise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_pp_ext.runtime import te_wgrad
from megatron_pp_ext.runtime.grad_check import GradCheckError, GradCheckPolicy, GradWatch
from megatron_pp_ext.runtime.te_wgrad import enable_te_wgrad
from megatron_pp_ext.runtime.wgrad import WeightGradStore
from megatron_pp_ext.verification.rank_pool import VerifyRunError, check_errors
from megatron_pp_ext.verification.run_spec import RunSpec
from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec

from . import te_standin as te
from .grad_check_helpers import run_with_w_that_computes_nothing

DATA = Path(__file__).parent / "data"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2))


def _run(watch: GradWatch, model: torch.nn.Module, skip: tuple[str, int] | None = None) -> None:
    gen = torch.Generator().manual_seed(1)
    for mb in range(3):
        handles = []
        if skip is not None and skip[1] == mb:  # this parameter's gradient is lost for this micro-batch
            param = dict(model.named_parameters())[skip[0]]
            handles.append(param.register_hook(lambda g: torch.zeros_like(g)))
        with watch.watch(0, mb):
            model(torch.randn(2, 3, generator=gen)).sum().backward()
        for h in handles:
            h.remove()


def test_every_gradient_arrived():
    model = _model()
    watch = GradWatch([model])
    _run(watch, model)
    assert watch.problems() == []
    watch.finish("rank 0")


def test_a_lost_gradient_is_named_with_chunk_and_microbatch():
    model = _model()
    watch = GradWatch([model])
    _run(watch, model, skip=("2.weight", 1))
    with pytest.raises(GradCheckError, match=r"2\.weight \(chunk 0\): no gradient for micro-batch\(es\) \[1\]"):
        watch.finish("pipeline rank 0")


def test_frozen_parameters_are_not_checked():
    model = _model()
    model[0].bias.requires_grad_(False)
    watch = GradWatch([model])
    _run(watch, model)
    watch.finish("rank 0")


def test_policy_watches_the_first_training_iteration_and_all_with_the_flag():
    models = [_model()]
    once = GradCheckPolicy()
    assert once.watcher(models, forward_only=True) is None  # evaluation does not count
    assert once.watcher(models, forward_only=False) is not None
    assert once.watcher(models, forward_only=False) is None
    always = GradCheckPolicy(every_iteration=True)
    assert all(always.watcher(models, forward_only=False) is not None for _ in range(3))


def test_te_w_that_computes_nothing_is_caught(monkeypatch):
    """A provider that runs its W closures but never calls backward_dw: the store is empty, the guard is not."""
    chunk = torch.nn.Sequential(te.Linear(4, 4, delay_wgrad_compute=True), te.Linear(4, 4, delay_wgrad_compute=True))
    monkeypatch.setattr(te_wgrad, "_consume", lambda added, chunk, microbatch: None)
    store = WeightGradStore()
    enable_te_wgrad(store)
    watch = GradWatch([chunk])
    gen = torch.Generator().manual_seed(2)
    for mb in range(2):
        with watch.watch(0, mb):
            with store.deferring(0, mb, enabled=True, where="t", model_chunk=chunk):
                chunk(torch.randn(2, 4, generator=gen)).sum().backward()
        with watch.watch(0, mb):
            store.run(0, mb, "t")
    store.check_empty("t")  # our store saw its closures run
    with pytest.raises(GradCheckError) as info:
        watch.finish("pipeline rank 0")
    text = str(info.value)
    assert "0.weight (chunk 0): no gradient for micro-batch(es) [0, 1]" in text
    assert "Transformer Engine weight-gradient entries left" in text


def test_guard_runs_in_the_first_iteration_of_a_real_split_pipeline(pool):
    """megatron-linear W closures that compute nothing: no store error, the guard raises in iteration 1."""
    spec = RunSpec(
        pp=2,
        num_microbatches=4,
        schedule_csv=(DATA / "1f1b_split_p2_m4.csv").read_text(),
        model=TinyGPTSpec(num_layers=2),
        iterations=1,
        split_backward=True,
    )
    results = pool.run_fn(run_with_w_that_computes_nothing, spec, spec.world_size, 300)
    with pytest.raises(VerifyRunError) as info:
        check_errors(results)
    text = str(info.value)
    assert "GradCheckError" in text and "no gradient for micro-batch(es) [0, 1, 2, 3]" in text
    assert "linear_fc1.weight" in text and "(chunk 0)" in text
