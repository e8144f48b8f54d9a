"""``--pipeline-schedule bitpipe`` refuses what it cannot run with one line naming the flag, before any
process group (pure: validate_arguments runs on the parsed flags, no megatron, no processes)."""

from __future__ import annotations

import pytest
from megatron_args_helpers import make_args

from megatron_pp_ext.integration.arguments import validate_arguments
from megatron_pp_ext.integration.config import PipelineArgumentError


@pytest.mark.parametrize("name", ["bitpipe", "bitpipe-zb"])
@pytest.mark.parametrize(
    ("shape", "start"),
    [
        (
            {"pipeline_model_parallel_size": 3, "num_layers": 12, "global_batch_size": 6},
            "argument --pipeline-model-parallel-size: pipeline schedule '{name}' cannot run with p=3",
        ),
        (
            {"pipeline_model_parallel_size": 4, "num_layers": 8, "global_batch_size": 6},
            "argument --global-batch-size: pipeline schedule '{name}' cannot run with p=4",
        ),
        (
            {"pipeline_model_parallel_size": 4, "num_layers": 12, "global_batch_size": 8},
            "argument --num-layers: 12 layers do not split evenly into the 8 pipeline stages of {name}",
        ),
    ],
)
def test_bad_shapes_name_their_flag(name: str, shape: dict[str, int], start: str) -> None:
    with pytest.raises(PipelineArgumentError) as info:
        validate_arguments(make_args(["--pipeline-schedule", name], **shape))
    text = str(info.value)
    assert text.startswith(start.format(name=name)), text
    assert "\n" not in text
    if shape["pipeline_model_parallel_size"] == 3:
        assert "even pipeline size" in text
    elif shape["global_batch_size"] == 6:
        assert "multiple of p=4" in text and "m=6" in text


def test_good_shape_passes() -> None:
    validate_arguments(make_args(["--pipeline-schedule", "bitpipe"], pipeline_model_parallel_size=4, num_layers=8))
