"""What megatron pickles into a checkpoint (``args``) must load with torch's weights-only unpickler."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch
from megatron_args_helpers import make_args

from megatron_pp_ext.integration.arguments import pipeline_config_of, validate_arguments


@pytest.fixture(autouse=True)
def megatron_safe_globals(megatron: object) -> None:
    """Importing megatron.core (conftest's fixture) registers its safe globals (argparse.Namespace, ...)."""


def _weights_only_round_trip(obj: object) -> object:
    buffer = io.BytesIO()
    torch.save({"args": obj}, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)["args"]


@pytest.mark.parametrize(
    "argv",
    [
        ["--pipeline-schedule", "zb-auto", "--pipeline-memory-limit", "2p", "--pipeline-costs", "1,2,1,0.1"],
        ["--pipeline-schedule", "v-zb", "--pipeline-memory-limit", "3"],
        ["--pipeline-schedule", "1f1b", "--pipeline-check-messages"],
        [],
    ],
)
def test_validated_args_load_weights_only(argv: list[str]) -> None:
    args = make_args(argv)
    config = validate_arguments(args)
    loaded = _weights_only_round_trip(args)
    assert vars(loaded) == vars(args)
    assert pipeline_config_of(args) is config


def test_cost_profile_file_stays_a_path_in_args(tmp_path: Path) -> None:
    profile = tmp_path / "costs.json"
    profile.write_text(json.dumps({"t_f": 1.0, "t_b": 2.0, "t_w": 1.0, "t_comm": 0.1}))
    args = make_args(["--pipeline-schedule", "zb-auto", "--pipeline-costs", str(profile)])
    config = validate_arguments(args)
    assert config.costs is not None and not isinstance(config.costs, str)
    assert _weights_only_round_trip(args).pipeline_costs == str(profile)
