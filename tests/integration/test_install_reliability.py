"""install(): the flags of the reliability checks reach the runtime; the pre-group agreement is patched in."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
from megatron_args_helpers import make_args

from megatron_pp_ext.integration import install as inst
from megatron_pp_ext.integration.arguments import validate_arguments
from megatron_pp_ext.integration.features.config_agreement import config_text
from megatron_pp_ext.schedules import generate

PS = "megatron.core.parallel_state"


@pytest.fixture
def clean(megatron: Any) -> Any:
    inst.uninstall()
    yield megatron
    inst.uninstall()


@pytest.mark.parametrize("flag", [True, False])
def test_check_messages_flag_reaches_the_executor(clean: Any, flag: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--pipeline-check-messages`` is an option of the executor install() builds (no process-wide state)."""
    from megatron_pp_ext.runtime import executor

    seen: dict[str, Any] = {}
    original = executor.make_forward_backward_func

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(executor, "make_forward_backward_func", recording)
    args = make_args(["--pipeline-schedule", "1f1b", *(["--pipeline-check-messages"] if flag else [])],
                     pipeline_model_parallel_size=2)  # fmt: skip
    inst.install(args)
    assert seen["check_messages"] is flag


def test_agreement_wraps_megatrons_group_setup_and_is_undone(clean: Any) -> None:
    original = sys.modules[PS].initialize_model_parallel
    inst.install(make_args(["--pipeline-schedule", "1f1b"], pipeline_model_parallel_size=2))
    assert sys.modules[PS].initialize_model_parallel is not original
    inst.uninstall()
    assert sys.modules[PS].initialize_model_parallel is original


def test_config_text_tells_schedules_and_file_contents_apart(tmp_path: Path) -> None:
    def text(argv: list[str]) -> str:
        return config_text(validate_arguments(make_args(argv, pipeline_model_parallel_size=2)))

    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text(generate("1f1b", 2, 8).to_csv())
    b.write_text(generate("gpipe", 2, 8).to_csv().replace("gpipe", "1f1b"))
    assert text(["--pipeline-schedule", "1f1b"]) != text(["--pipeline-schedule", "v-half"])
    assert text(["--pipeline-schedule-file", str(a)]) != text(["--pipeline-schedule-file", str(b)])
    assert text(["--pipeline-schedule", "1f1b"]) == text(["--pipeline-schedule", "1F1B"])
