"""megatron-core's own Transformer Engine wrappers, built over the CPU stand-in (tests/runtime/te_standin.py).

megatron-core 0.19.2 defines ``TEGroupedLinear`` / ``TEColumnParallelGroupedLinear`` /
``TERowParallelGroupedLinear`` in ``megatron/core/extensions/transformer_engine.py`` only when
``import transformer_engine`` works. :func:`megatron_te_over_standin` executes that same file a second time,
as a separate module, while a stand-in ``transformer_engine`` package is importable, so that its classes
subclass the stand-in's layers: megatron's wrapper code (constructor arguments, the expert parallel
groups, ``forward(x, m_splits)``, its config-gated ``backward_dw``) runs unchanged, only TE's GEMMs are
plain matmuls. megatron's usual extension module and everything else megatron imports stay as they were.

While the context is open megatron's ``get_te_version()`` answers the stand-in's version (2.12.0, inside
the adapter's supported range); the wrappers ask it while they are built, so build the model inside.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from collections.abc import Iterator
from typing import Any
from unittest import mock

from . import te_standin

STANDIN_TE_VERSION = "2.12.0"
_EXTENSION = "megatron.core.extensions.transformer_engine"
_LOADED_AS = "megatron.core.extensions._transformer_engine_over_standin"
_PACKAGES = (
    "transformer_engine",
    "transformer_engine.pytorch",
    "transformer_engine.pytorch.fp8",
    "transformer_engine.pytorch.router",
    "transformer_engine.common",
    "transformer_engine.common.recipe",
)


def _standin_package() -> dict[str, Any]:
    """``sys.modules`` entries of a ``transformer_engine`` whose layers are the stand-in's; every other name
    (FP8 state, recipes, attention, RNG trackers) is a mock megatron's module only references at import."""
    modules: dict[str, Any] = {}
    for name in _PACKAGES:
        module = mock.MagicMock(name=name)
        module.__name__, module.__spec__, module.__path__ = name, None, []
        modules[name] = module
    te, te_pt = modules["transformer_engine"], modules["transformer_engine.pytorch"]
    te.__version__ = STANDIN_TE_VERSION
    te.pytorch, te.common = te_pt, modules["transformer_engine.common"]
    te.common.recipe = modules["transformer_engine.common.recipe"]
    te_pt.fp8 = modules["transformer_engine.pytorch.fp8"]
    te_pt.Linear, te_pt.LayerNormMLP, te_pt.GroupedLinear = (
        te_standin.Linear,
        te_standin.LayerNormMLP,
        te_standin.GroupedLinear,
    )
    return modules


@contextlib.contextmanager
def megatron_te_over_standin() -> Iterator[types.ModuleType]:
    """Yield megatron's ``extensions/transformer_engine.py`` executed over the stand-in (see module doc)."""
    import megatron.core.utils as mcore_utils

    saved_modules = {name: sys.modules.get(name) for name in _PACKAGES}
    saved_version = mcore_utils._te_version
    try:
        sys.modules.update(_standin_package())
        mcore_utils._te_version = None  # cached: asked again, it answers the stand-in's version
        loaded = sys.modules.get(_LOADED_AS)
        if loaded is None:
            origin = importlib.util.find_spec(_EXTENSION).origin  # type: ignore[union-attr]
            spec = importlib.util.spec_from_file_location(_LOADED_AS, origin)
            assert spec is not None and spec.loader is not None
            loaded = importlib.util.module_from_spec(spec)
            sys.modules[_LOADED_AS] = loaded
            spec.loader.exec_module(loaded)
        assert loaded.HAVE_TE and loaded.TEGroupedLinear is not None, "megatron did not take the stand-in"
        yield loaded
    finally:
        mcore_utils._te_version = saved_version
        for name, module in saved_modules.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module


def grouped_moe_layer_spec(extension: types.ModuleType, num_experts: int) -> Any:
    """megatron's local GPT layer spec with MoE whose experts are ``TEGroupedMLP`` over ``extension``'s
    grouped linears: what megatron's TE spec provider returns for ``--moe-grouped-gemm``
    (``TESpecProvider.grouped_mlp_modules``)."""
    from functools import partial

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.moe.experts import GroupedMLPSubmodules, TEGroupedMLP

    spec = get_gpt_layer_local_spec(num_experts=num_experts)
    moe = spec.submodules.mlp
    experts = partial(
        TEGroupedMLP,
        submodules=GroupedMLPSubmodules(
            linear_fc1=extension.TEColumnParallelGroupedLinear,
            linear_fc2=extension.TERowParallelGroupedLinear,
            activation_func=None,
        ),
    )
    moe_submodules = type(moe.keywords["submodules"])(**{**vars(moe.keywords["submodules"]), "experts": experts})
    spec.submodules.mlp = partial(moe.func, *moe.args, **{**moe.keywords, "submodules": moe_submodules})
    return spec
