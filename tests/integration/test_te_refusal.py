"""Split schedules with the Transformer Engine layer spec: refused from the flags when TE cannot split."""

from __future__ import annotations

import sys
from typing import Any

import pytest
from megatron_args_helpers import make_args

from megatron_pp_ext.integration.arguments import validate_arguments, validate_arguments_or_exit
from megatron_pp_ext.integration.config import PipelineArgumentError


@pytest.fixture
def te_problem(monkeypatch):
    """Pretend the installed TE is 2.9 (this machine has none: te_support_problem would say so instead)."""
    from megatron_pp_ext.runtime import te_wgrad

    problem = "Transformer Engine 2.9.0 found, the B/W split needs >= 2.10"
    monkeypatch.setattr(te_wgrad, "te_support_problem", lambda *a, **k: problem)
    return problem


def test_split_schedule_with_te_spec_and_old_te_is_refused(te_problem):
    args = make_args(["--pipeline-schedule", "zb-h1"], transformer_impl="transformer_engine")
    with pytest.raises(PipelineArgumentError) as info:
        validate_arguments(args)
    text = str(info.value)
    assert text.startswith("argument --transformer-impl:")
    assert te_problem in text and "--transformer-impl local" in text and "unsplit schedule" in text
    assert "\n" not in text


def test_refusal_is_one_line_and_exit_2(te_problem, capsys):
    args = make_args(["--pipeline-schedule", "v-zb"], transformer_impl="transformer_engine", num_layers=8)
    with pytest.raises(SystemExit) as info:
        validate_arguments_or_exit(args)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "v-zb" in err[0] and "2.9.0" in err[0] and ">= 2.10" in err[0]


@pytest.mark.parametrize(("schedule", "impl"), [("1f1b", "transformer_engine"), ("zb-h1", "local")])
def test_unsplit_schedule_or_local_spec_is_not_refused(te_problem, schedule, impl):
    validate_arguments(make_args(["--pipeline-schedule", schedule], transformer_impl=impl))


def test_without_te_installed_the_split_is_refused_naming_it():
    pytest.importorskip("torch")
    try:
        import transformer_engine  # noqa: F401

        pytest.skip("Transformer Engine is importable here")
    except Exception:
        pass
    with pytest.raises(PipelineArgumentError, match="Transformer Engine is not importable"):
        validate_arguments(make_args(["--pipeline-schedule", "zb-h1"], transformer_impl="transformer_engine"))


def test_check_grads_flag():
    assert validate_arguments(make_args(["--pipeline-schedule", "zb-h1", "--pipeline-check-grads"])).check_grads
    assert not validate_arguments(make_args(["--pipeline-schedule", "zb-h1"])).check_grads
    with pytest.raises(PipelineArgumentError, match="--pipeline-check-grads: needs --pipeline-schedule"):
        validate_arguments(make_args(["--pipeline-check-grads"]))


# ---- install() with a (fake) Transformer Engine present ------------------------------------------------
def _fake_te(monkeypatch, version: str) -> Any:
    import importlib.machinery
    import types

    import torch

    class Linear(torch.nn.Module):  # the API surface te_support_problem / patch_for_split look at
        def __init__(self, n: int = 2, delay_wgrad_compute: bool = False) -> None:
            super().__init__()
            self.delay = delay_wgrad_compute

        def need_backward_dw(self) -> bool:
            return self.delay

        def backward_dw(self) -> None: ...

        def register_wgrad_accumulation_and_reduce_hooks(self, hook: Any) -> None: ...

    te_root = types.ModuleType("transformer_engine")
    te_root.__version__ = version
    te_root.__spec__ = importlib.machinery.ModuleSpec("transformer_engine", None)
    te_pt = types.ModuleType("transformer_engine.pytorch")
    te_pt.Linear = Linear
    te_root.pytorch = te_pt
    monkeypatch.setitem(sys.modules, "transformer_engine", te_root)
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", te_pt)
    monkeypatch.setitem(sys.modules, "megatron.core.extensions.transformer_engine", types.ModuleType("te_ext_stand_in"))
    return Linear


def test_install_with_te_patches_layers_and_ddp_and_uninstall_restores(megatron, monkeypatch):
    from megatron.core.distributed import DistributedDataParallel

    from megatron_pp_ext.integration import install as inst
    from megatron_pp_ext.runtime.te_wgrad import TEDeferral
    from megatron_pp_ext.runtime.wgrad import get_weight_grad_store

    linear = _fake_te(monkeypatch, "2.12.0")
    inst.uninstall()
    ddp_init = DistributedDataParallel.__init__
    try:
        assert inst.install(make_args(["--pipeline-schedule", "zb-h1"])) is not None
        assert linear().need_backward_dw(), "TE layers must defer by default under a split schedule"
        assert getattr(DistributedDataParallel.__init__, "megatron_pp_ext", False)
        assert any(isinstance(p, TEDeferral) for p in get_weight_grad_store().providers)
    finally:
        inst.uninstall()
    assert not linear().need_backward_dw()
    assert DistributedDataParallel.__init__ is ddp_init
    assert not any(isinstance(p, TEDeferral) for p in get_weight_grad_store().providers)


def test_install_refuses_an_old_te(megatron, monkeypatch):
    from megatron_pp_ext.integration import install as inst
    from megatron_pp_ext.runtime.te_wgrad import TEUnsupportedError
    from megatron_pp_ext.runtime.wgrad import get_weight_grad_store

    _fake_te(monkeypatch, "2.8.1")
    inst.uninstall()
    schedules = sys.modules["megatron.core.pipeline_parallel.schedules"]
    before = schedules.get_forward_backward_func
    try:
        with pytest.raises(TEUnsupportedError, match=r"Transformer Engine 2\.8\.1 found.*--transformer-impl local"):
            inst.install(make_args(["--pipeline-schedule", "zb-h1"]))
        assert inst.installed() is None
        assert schedules.get_forward_backward_func is before, "a refused install left megatron patched"
        assert not get_weight_grad_store().hooks_installed
    finally:
        inst.uninstall()
