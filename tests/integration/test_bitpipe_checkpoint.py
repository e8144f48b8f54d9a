"""End to end (scripts/pretrain_gpt.py, CPU, PP=2): BitPipe's two model copies in checkpoints and logged losses.

* A ``bitpipe`` checkpoint (``torch_dist``) holds each weight once: its keys and shapes are exactly
  those of a ``1f1b`` checkpoint of the same model.
* Across schedules: a checkpoint saved under ``1f1b`` (``bitpipe``) and resumed for one iteration
  under ``bitpipe`` (``1f1b``) gives the same loss for every micro-batch as resuming under the
  schedule that saved it. Under ``bitpipe`` half of the micro-batches run through the up copy,
  so both copies must hold the saved weights.
* Loaded under the other schedule and saved again at once (megatron's ``--ckpt-convert-format``):
  every weight of the new checkpoint equals the one loaded, bit for bit.
* The loss megatron logs under ``bitpipe`` is the mean over all micro-batches of both replicas
  (their losses end on two ranks), equal to ``1f1b``'s on the same weights; so is its gradient norm
  (the up copies are not counted twice).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from test_megatron_pretrain import FLAGS
from warm_launch import launch, run_env

from megatron_pp_ext.integration.losses import loss_microbatches
from megatron_pp_ext.schedules import generate

ROOT = Path(__file__).resolve().parents[2]
P, M = 2, 4  # global batch 8 / micro-batch 2
LOGGED = re.compile(r"iteration\s+(\d+)/\s*\d+ .*lm loss: ([0-9.E+-]+) .*grad norm: ([0-9.]+)")


def _flags(extra: list[str]) -> list[str]:
    flags = list(FLAGS)
    flags[flags.index("--train-iters") + 1] = "3"
    # no dropout: its random streams differ between placements (megatron seeds each pipeline rank)
    return [*flags, "--ckpt-format", "torch_dist", "--hidden-dropout", "0", "--attention-dropout", "0", *extra]


def _launch(tmp: Path, name: str, extra: list[str]) -> tuple[Any, Path]:
    return launch(tmp, name, _flags(extra), nproc=P, env=run_env(MEGATRON_PP_EXT_LOSS_FILE=str(tmp / f"{name}.loss")))


def run_all(tmp: Path, runs: dict[str, list[str]]) -> dict[str, str]:
    """Run the named pretrain_gpt jobs concurrently; return their logs (each must succeed)."""
    started = {name: _launch(tmp, name, extra) for name, extra in runs.items()}
    logs = {}
    for name, (proc, log) in started.items():
        try:
            code = proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        logs[name] = log.read_text()
        assert code == 0, f"{name} failed:\n{logs[name][-4000:]}"
    return logs


def losses_by_microbatch(tmp: Path, name: str, schedule: str) -> list[float]:
    """The exact loss of each micro-batch of the one iteration run, from every rank that computed some."""
    order = generate(schedule, P, M)
    found: dict[int, float] = {}
    for rank in range(P):
        path = tmp / f"{name}.loss.rank{rank}"
        if not path.exists():
            continue
        values = [float.fromhex(x) for x in path.read_text().split()]
        mbs = loss_microbatches(order, rank)
        assert len(values) == len(mbs), (name, rank, values, mbs)
        found.update(zip(mbs, values, strict=True))
    assert sorted(found) == list(range(M)), (name, found)
    return [found[mb] for mb in range(M)]


def logged(log: str, iteration: int) -> tuple[str, str]:
    """Megatron's logged loss and gradient norm of one iteration."""
    values = [(loss, norm) for it, loss, norm in LOGGED.findall(log) if int(it) == iteration]
    assert len(values) == 1, log[-3000:]
    return values[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoints at iteration 2 under 1f1b and under bitpipe (directories ckpt-1f1b, ckpt-bitpipe)."""
    tmp = tmp_path_factory.mktemp("bitpipe_ckpt")
    run_all(
        tmp,
        {
            f"save-{s}": ["--pipeline-schedule", s, "--save", str(tmp / f"ckpt-{s}"), "--save-interval", "2",
                          "--exit-interval", "2"]
            for s in ("1f1b", "bitpipe")
        },
    )  # fmt: skip
    return tmp


def _keys(directory: Path) -> dict[str, tuple[int, ...]]:
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(directory / "iter_0000002")).read_metadata().state_dict_metadata
    return {key: tuple(getattr(value, "size", ())) for key, value in metadata.items()}


def _weights(directory: Path) -> dict[str, torch.Tensor]:
    """The model's tensors (no optimizer state) of a torch_dist checkpoint at iteration 2, read in this process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = directory / "weights.pt"
    dcp_to_torch_save(str(directory / "iter_0000002"), str(out))
    state = torch.load(out, weights_only=False)
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and not k.startswith("optimizer")}


@pytest.mark.gloo
def test_bitpipe_checkpoint_holds_one_model(saved: Path) -> None:
    bitpipe, one_f_one_b = _keys(saved / "ckpt-bitpipe"), _keys(saved / "ckpt-1f1b")
    assert "embedding.word_embeddings.weight" in bitpipe
    assert bitpipe == one_f_one_b


@pytest.mark.gloo
@pytest.mark.parametrize("saved_under", ["1f1b", "bitpipe"])
def test_checkpoint_resumes_under_the_other_schedule(
    tmp_path: Path, saved: Path, saved_under: str, megatron: object
) -> None:
    other = "1f1b" if saved_under == "bitpipe" else "bitpipe"
    ckpt = str(saved / f"ckpt-{saved_under}")
    # one pair with megatron's per-token loss: the gradients are divided by the tokens of both replicas
    per_token = ["--calculate-per-token-loss"] if saved_under == "bitpipe" else []
    logs = run_all(
        tmp_path,
        {saved_under: ["--pipeline-schedule", saved_under, "--load", ckpt, *per_token],
         other: ["--pipeline-schedule", other, "--load", ckpt, *per_token],
         "convert": ["--pipeline-schedule", other, "--load", ckpt, "--ckpt-convert-format", "torch_dist",
                     "--ckpt-convert-save", str(tmp_path / "resaved")]},
    )  # fmt: skip
    for log in logs.values():
        assert "successfully loaded checkpoint" in log, log[-3000:]
    same = losses_by_microbatch(tmp_path, saved_under, saved_under)
    across = losses_by_microbatch(tmp_path, other, other)
    assert across == same  # bitwise: the same weights and data through the same layers
    loaded, resaved = _weights(saved / f"ckpt-{saved_under}"), _weights(tmp_path / "resaved" / "torch_dist")
    assert loaded.keys() == resaved.keys() and len(loaded) > 10
    assert [k for k in loaded if not torch.equal(loaded[k], resaved[k])] == []
    # megatron's logged loss: the mean over all micro-batches, also under bitpipe; its gradient norm counts
    # each weight once (the up copies are marked shared), so clipping acts as under 1f1b
    assert logged(logs[other], 3) == logged(logs[saved_under], 3)
