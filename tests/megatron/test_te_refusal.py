"""Split schedules with the Transformer Engine layer spec: refused from the flags when TE cannot split."""

from __future__ import annotations

import pytest
from megatron_args_helpers import make_args

from megatron_pp_ext.megatron.arguments import PipelineArgumentError, validate_arguments, validate_arguments_or_exit


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
