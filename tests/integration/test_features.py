"""The feature adapters (megatron_pp_ext/integration/features/): every feature registered once and in
its declared order, each PipelineConfig flag owned by one feature at most, and a registered feature is
reached by the flag validation and by install() without any other change (adding a feature = one module)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from megatron_args_helpers import make_args

from megatron_pp_ext.integration import install as inst
from megatron_pp_ext.integration.arguments import validate_arguments
from megatron_pp_ext.integration.config import PipelineArgumentError, PipelineConfig
from megatron_pp_ext.integration.features import ORDER, Feature, Wiring, base, features


def test_every_feature_registered_once_in_its_order() -> None:
    names = [feature.name for feature in features()]
    assert names == list(ORDER)


def test_each_flag_field_has_at_most_one_owner() -> None:
    flag_fields = {f.name for f in dataclasses.fields(PipelineConfig) if "flag" in f.metadata}
    owners: dict[str, str] = {}
    for feature in features():
        for name in feature.fields:
            assert name in flag_fields, f"{feature.name} claims {name}, not a PipelineConfig flag field"
            assert name not in owners, f"{name} owned by {owners.get(name)} and {feature.name}"
            owners[name] = feature.name


class _Refusing(Feature):
    name = "test-refusing"

    def check(self, args: Any, config: PipelineConfig) -> None:
        if config.selected and getattr(args, "refuse_me", False):
            raise PipelineArgumentError("--refuse-me", "refused by a registered feature")


class _Wrapping(Feature):
    name = "test-wrapping"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def prepare(self, wiring: Wiring) -> None:
        def wrapper(inner: Any) -> Any:
            def forward_backward_func(**kwargs: Any) -> Any:
                self.calls.append("around")
                return "wrapped"

            return forward_backward_func

        wiring.wrap(wrapper)


def test_a_registered_feature_is_checked_without_other_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(base, "_REGISTERED", [*base._REGISTERED])
    base.register(_Refusing())
    assert features()[-1].name == "test-refusing"  # not in ORDER: after the declared ones
    args = make_args(["--pipeline-schedule", "1f1b"], pipeline_model_parallel_size=2)
    args.refuse_me = True
    with pytest.raises(PipelineArgumentError, match="--refuse-me: refused by a registered feature"):
        validate_arguments(args)
    args.refuse_me = False
    assert validate_arguments(args).schedule == "1f1b"


def test_a_registered_feature_wraps_what_megatron_calls(monkeypatch: pytest.MonkeyPatch, megatron: Any) -> None:
    monkeypatch.setattr(base, "_REGISTERED", [*base._REGISTERED])
    wrapping = _Wrapping()
    base.register(wrapping)
    inst.uninstall()
    try:
        fbf = inst.install(PipelineConfig(schedule="1f1b", pipeline_parallel_size=2))
        assert fbf is not None and fbf() == "wrapped" and wrapping.calls == ["around"]
    finally:
        inst.uninstall()
