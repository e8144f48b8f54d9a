"""install() / uninstall(): which megatron attributes change, idempotence, and restoration.

Imports megatron in the test process (import-time shims only, see conftest); no process groups.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest
from megatron_args_helpers import make_args

from megatron_pp_ext.integration import install as inst
from megatron_pp_ext.integration import layout
from megatron_pp_ext.integration.arguments import pipeline_config_of
from megatron_pp_ext.integration.config import PipelineConfig

HOLDERS = ("megatron.core.pipeline_parallel.schedules", "megatron.core.pipeline_parallel", "megatron.training.training")


def current(megatron: Any) -> list[Any]:
    return [sys.modules[name].get_forward_backward_func for name in HOLDERS]


@pytest.fixture
def clean(megatron: Any) -> Any:
    inst.uninstall()
    yield megatron
    inst.uninstall()


def test_no_schedule_leaves_megatron_untouched(clean: Any) -> None:
    before = current(clean)
    assert inst.install(make_args()) is None
    assert current(clean) == before
    assert inst.installed() is None
    assert layout.active() is None


def test_install_patches_every_holder_and_is_idempotent(clean: Any) -> None:
    original = sys.modules[HOLDERS[0]].get_forward_backward_func
    assert current(clean) == [original] * 3
    args = make_args(["--pipeline-schedule", "1f1b"], pipeline_model_parallel_size=2)
    fbf = inst.install(args)
    assert fbf is not None and fbf.megatron_pp_ext
    patched = current(clean)
    assert patched[0] is not original and patched == [patched[0]] * 3
    # what megatron's training loop gets, with the arguments it passes
    assert patched[0]() is fbf
    assert patched[0](schedule_pg_collection=object()) is fbf
    assert patched[0](pp_size=2, vp_size=None) is fbf
    # idempotent: same function, same patch
    assert inst.install(args) is fbf
    assert inst.install(pipeline_config_of(args)) is fbf
    assert current(clean) == patched
    # a module importing it by name while installed is restored too
    late = types.ModuleType("megatron._megatron_pp_ext_late_import")
    late.get_forward_backward_func = patched[0]  # type: ignore[attr-defined]
    sys.modules[late.__name__] = late
    try:
        inst.uninstall()
        assert current(clean) == [original] * 3
        assert late.get_forward_backward_func is original  # type: ignore[attr-defined]
    finally:
        del sys.modules[late.__name__]
    inst.uninstall()  # no-op
    assert current(clean) == [original] * 3


def test_reinstall_with_another_schedule_replaces_the_first(clean: Any) -> None:
    original = sys.modules[HOLDERS[0]].get_forward_backward_func
    first = inst.install(PipelineConfig(schedule="1f1b", pipeline_parallel_size=2))
    second = inst.install(PipelineConfig(schedule="gpipe", pipeline_parallel_size=2))
    assert first is not second
    assert current(clean)[0]() is second
    assert inst.installed() == PipelineConfig(schedule="gpipe", pipeline_parallel_size=2)
    # selecting nothing uninstalls
    assert inst.install(PipelineConfig()) is None
    assert current(clean) == [original] * 3


def test_multi_module_pipelines_keep_megatrons_schedule(clean: Any) -> None:
    from megatron.core.process_groups_config import MultiModuleProcessGroupCollection

    original = sys.modules[HOLDERS[0]].get_forward_backward_func
    inst.install(PipelineConfig(schedule="1f1b", pipeline_parallel_size=2))
    collection = MultiModuleProcessGroupCollection.__new__(MultiModuleProcessGroupCollection)
    assert current(clean)[0](schedule_pg_collection=collection) is original(schedule_pg_collection=collection)


def test_schedule_source_builds_validates_and_caches(clean: Any) -> None:
    config = PipelineConfig(schedule="interleaved-1f1b", pipeline_parallel_size=2, num_virtual_stages=2)
    schedule_for = inst.make_schedule_source(config)
    schedule = schedule_for(4)
    assert schedule.name == "interleaved-1f1b" and schedule.num_microbatches == 4 and schedule.chunks_per_rank == 2
    assert schedule_for(4) is schedule
    assert schedule_for(6).num_microbatches == 6
    with pytest.raises(ValueError, match="cannot run 1 micro-batches on 2 ranks"):
        schedule_for(1)


def test_layout_hooks_follow_the_placement(clean: Any) -> None:
    # loop placement: megatron's own layout is right, no hooks unless forced
    inst.install(PipelineConfig(schedule="1f1b", pipeline_parallel_size=2, num_layers=4))
    assert layout.active() is None
    inst.install(PipelineConfig(schedule="1f1b", pipeline_parallel_size=4, num_layers=4), layout_hooks=True)
    active = layout.active()
    assert active is not None and active[0].style == "loop" and active[1] == 4
    inst.uninstall()
    assert layout.active() is None


def test_megatron_lm_patch_applies() -> None:
    """The upstream patch applies to a Megatron-LM checkout named by $MEGATRON_LM_DIR (skipped otherwise)."""
    import os
    import subprocess
    from pathlib import Path

    checkout = os.environ.get("MEGATRON_LM_DIR")
    if not checkout:
        pytest.skip("set MEGATRON_LM_DIR to a Megatron-LM checkout to check the patch")
    patch = Path(__file__).resolve().parents[2] / "patches" / "megatron_lm_pretrain_gpt.patch"
    result = subprocess.run(["git", "apply", "--check", str(patch)], cwd=checkout, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
