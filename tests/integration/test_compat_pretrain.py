"""Compatibility-matrix cells that need megatron's own training loop: bf16 under ``pretrain_gpt.py``.

Megatron's own 1F1B trains the tiny model one iteration in bf16 (megatron's mixed precision: bf16 weights and
activations, fp32 main gradients and optimizer) and saves a ``torch_dist`` checkpoint; megatron's 1F1B and each
schedule family's representative (``tests/compat_matrix.py``) load it and train two more iterations. (Starting from
the checkpoint, not from initialization: megatron seeds each pipeline rank's initialization, so another placement
would start from other weights; ``torch_dist`` loads exactly under any placement, ``test_checkpoint_reload.py``.)
For one pipeline copy the schedules do the same floating-point operations per layer and micro-batch, and each
parameter's fp32 gradient accumulates its micro-batches in the same order (a W pass runs the micro-batches of its
stage in order), so every micro-batch's loss of every iteration and megatron's logged loss and grad norm must be
bitwise megatron's. BitPipe's two copies each sum half of the micro-batches and then add the two
partial sums, another grouping of the same fp32 sum: the first iteration's losses (weights as loaded) must be
bitwise, the later ones may differ where a last-bit difference of an fp32 main weight flips the rounding of its bf16
copy (one bf16 step, a relative 2^-8 of that weight): the bound asserted is that of every loss, 2^-8 relative.
(Gradient errors of the schedule itself are the fp32 verification cells' job; this cell checks that megatron's
mixed precision trains under the schedule.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_megatron_pretrain import FLAGS, LOG_LINE
from warm_launch import launch, run_env

from megatron_pp_ext.integration.losses import loss_microbatches
from megatron_pp_ext.schedules import generate
from tests.compat_matrix import ROWS

P, M, ITERS = 2, 4, 2  # iterations after the checkpoint
BIDIRECTIONAL = {"bitpipe"}


def _start(tmp: Path, name: str, extra: list[str]) -> tuple[Any, Path]:
    flags = [*FLAGS, "--bf16", "--hidden-dropout", "0", "--attention-dropout", "0", "--ckpt-format", "torch_dist"]
    flags[flags.index("--train-iters") + 1] = str(1 + ITERS)
    if "--save" not in extra:
        flags += ["--load", str(tmp / "ckpt"), "--ckpt-step", "1"]
    flags += extra
    return launch(tmp, name, flags, nproc=P, env=run_env(MEGATRON_PP_EXT_LOSS_FILE=str(tmp / f"{name}.loss")))


def _finish(run: tuple[Any, Path]) -> str:
    proc, log = run
    code = proc.wait(timeout=300)
    text = log.read_text()
    assert code == 0, text[-4000:]
    return text


def _losses(tmp: Path, name: str, schedule: str) -> list[list[float]]:
    """Per iteration after the checkpoint, the loss of each micro-batch, from every rank that computed some."""
    order = generate(schedule, P, M)
    found: dict[int, list[float]] = {}
    for rank in range(P):
        path = tmp / f"{name}.loss.rank{rank}"
        if path.exists():
            mbs = loss_microbatches(order, rank)
            values = [float.fromhex(x) for x in path.read_text().split()][-ITERS * len(mbs) :]
            for i, value in enumerate(values):
                found.setdefault(i // len(mbs), [0.0] * M)[mbs[i % len(mbs)]] = value
    assert sorted(found) == list(range(ITERS)), (name, found)
    return [found[i] for i in range(ITERS)]


@pytest.fixture(scope="module")
def megatron(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """Megatron's 1F1B: the checkpoint after one iteration, then the log of a run loading it. (Loading is part of
    the reference: in bf16 megatron rebuilds state on load, so a loaded run is not the saving run continued.)"""
    tmp = tmp_path_factory.mktemp("bf16")
    _finish(_start(tmp, "save", ["--save", str(tmp / "ckpt"), "--save-interval", "1", "--exit-interval", "1"]))
    return tmp, _finish(_start(tmp, "megatron", []))


@pytest.mark.gloo
@pytest.mark.parametrize("schedule", list(ROWS.values()))
def test_bf16_losses_equal_megatrons_1f1b(megatron: tuple[Path, str], schedule: str) -> None:
    tmp, reference_log = megatron
    text = _finish(_start(tmp, schedule, ["--pipeline-schedule", schedule]))
    ours, reference = _losses(tmp, schedule, schedule), _losses(tmp, "megatron", "1f1b")
    if schedule not in BIDIRECTIONAL:
        assert ours == reference
        assert LOG_LINE.findall(text) == LOG_LINE.findall(reference_log)[-ITERS:]
        return
    assert ours[0] == reference[0]
    for got, want in zip(ours[1:], reference[1:], strict=True):
        for a, b in zip(got, want, strict=True):
            assert abs(a - b) <= 2**-8 * abs(b), (schedule, ours, reference)
