"""Fixtures of the megatron-integration tests.

``megatron`` fixture: imports megatron-core in the test process with only the import-time
shims (the triton stub and ``typing.override``), none of CPU mode's global torch patches.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest


@pytest.fixture(scope="session")
def megatron() -> Any:
    if importlib.util.find_spec("megatron.core") is None:
        pytest.skip("megatron-core is not installed")
    from megatron_pp_ext.integration import cpu

    cpu._define_typing_override()
    cpu._stub_triton_modules()
    import megatron as megatron_package
    import megatron.core.pipeline_parallel.schedules
    import megatron.training.training

    return megatron_package
