"""End to end: scripts/pretrain_gpt.py checkpoints across a schedule change (CPU, PP=2, dropout 0).

Saved under ``1f1b`` after 2 of 3 iterations in each format megatron offers that runs on CPU
(``torch``, ``torch_dist``), then loaded under other schedules for the third iteration (:data:`LOADS`):

* every load docs/megatron.md ("Failure modes") claims is exact: the loss of every micro-batch of the loaded run's first
  iteration is bitwise the saving run's third-iteration loss (same data, same weights). ``torch_dist``
  under any placement; ``torch`` under the same placement (megatron's own load) or, with
  ``--no-load-optim``, under another one (its weights moved onto this run's chunks, said in one line);
* ``torch`` under another placement with its optimizer state stops before training with one line
  naming both layouts and the ways that work (megatron alone prints "successfully loaded" and trains a
  model it did not load).

Also: a checkpoint megatron cannot read exits non-zero (megatron itself exits 0 there), and a run
saving into a directory another live run holds is refused with one line naming the owner, while a
dead owner's lock is taken over (the saving runs start on one) and released at exit.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_megatron_pretrain import FLAGS
from warm_launch import launch, run_env

from megatron_pp_ext.integration.losses import loss_microbatches
from megatron_pp_ext.integration.save_lock import LOCK_NAME
from megatron_pp_ext.schedules import generate

ROOT = Path(__file__).resolve().parents[2]
P, M = 2, 4  # global batch 8 / micro-batch 2
FORMATS = ("torch", "torch_dist")
SAVED_UNDER = "1f1b"
# name: (format, schedule loading it, extra flags, what must happen)
LOADS = {
    "torch-zb-h1": ("torch", "zb-h1", [], "same"),  # same placement: megatron's own load
    "torch-v-half": ("torch", "v-half", ["--no-load-optim"], "moved"),  # weights moved onto the V chunks
    "torch-interleaved-1f1b": ("torch", "interleaved-1f1b", [], "refused"),  # optimizer state cannot move
    "torch_dist-interleaved-1f1b": ("torch_dist", "interleaved-1f1b", [], "same"),
    "torch_dist-v-half": ("torch_dist", "v-half", [], "same"),
    "torch_dist-v-zb": ("torch_dist", "v-zb", [], "same"),
    "torch_dist-dualpipev": ("torch_dist", "dualpipev", [], "same"),
}
WAVE = 4  # runs at a time (2 processes each)
HOLD = """
import sys
from megatron_pp_ext.integration.save_lock import SaveDirLock
print("refused" if SaveDirLock(sys.argv[1]).acquire() else "held", flush=True)
sys.stdin.read()  # a live run holding the directory until the test closes stdin
"""


def _flags(extra: list[str]) -> list[str]:
    flags = list(FLAGS)
    flags[flags.index("--train-iters") + 1] = "3"
    return [*flags, "--hidden-dropout", "0", "--attention-dropout", "0", *extra]


def _launch(tmp: Path, name: str, extra: list[str]) -> tuple[Any, Path]:
    return launch(tmp, name, _flags(extra), nproc=P, env=run_env(MEGATRON_PP_EXT_LOSS_FILE=str(tmp / f"{name}.loss")))


def run_all(tmp: Path, runs: dict[str, list[str]]) -> dict[str, tuple[int, str]]:
    """Run the named pretrain_gpt jobs, :data:`WAVE` at a time; their exit codes and logs."""
    results: dict[str, tuple[int, str]] = {}
    names = list(runs)
    for start in range(0, len(names), WAVE):
        started = {name: _launch(tmp, name, runs[name]) for name in names[start : start + WAVE]}
        for name, (proc, log) in started.items():
            try:
                code = proc.wait(timeout=300)
            except subprocess.TimeoutExpired:
                proc.kill()
                raise
            results[name] = (code, log.read_text())
    return results


def losses(tmp: Path, name: str, schedule: str) -> list[float]:
    """The exact loss of each micro-batch of the run's last iteration, from every rank that computed some."""
    order = generate(schedule, P, M)
    found: dict[int, float] = {}
    for rank in range(P):
        path = tmp / f"{name}.loss.rank{rank}"
        if path.exists():
            mbs = loss_microbatches(order, rank)
            values = [float.fromhex(x) for x in path.read_text().split()][-len(mbs) :]
            found.update(zip(mbs, values, strict=True))
    assert sorted(found) == list(range(M)), (name, found)
    return [found[mb] for mb in range(M)]


def _dead_lock(directory: Path, pid: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / LOCK_NAME
    path.write_text(json.dumps({"pid": pid, "host": socket.gethostname(), "started": "2026-01-01T00:00:00Z"}))
    return path


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[float]]:
    """Checkpoints at iteration 2 in each format (directories ckpt-<format>) and the saving runs' third-iteration
    losses (the same in both formats). Each saving run starts on a dead run's lock and must take it over."""
    tmp = tmp_path_factory.mktemp("ckpt_reload")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for fmt in FORMATS:
        _dead_lock(tmp / f"ckpt-{fmt}", dead.pid)
    results = run_all(
        tmp,
        {f"save-{fmt}": ["--pipeline-schedule", SAVED_UNDER, "--ckpt-format", fmt, "--save", str(tmp / f"ckpt-{fmt}"),
                         "--save-interval", "2"]
         for fmt in FORMATS},
    )  # fmt: skip
    for fmt in FORMATS:
        code, log = results[f"save-{fmt}"]
        assert code == 0, log[-4000:]
        assert f"took over the stale lock of --save {tmp / f'ckpt-{fmt}'} (pid {dead.pid}" in log, log[-4000:]
        assert not (tmp / f"ckpt-{fmt}" / LOCK_NAME).exists()  # released at exit
    next_losses = losses(tmp, "save-torch", SAVED_UNDER)
    assert losses(tmp, "save-torch_dist", SAVED_UNDER) == next_losses
    return tmp, next_losses


@pytest.fixture(scope="module")
def loaded(saved: tuple[Path, list[float]]) -> tuple[Path, dict[str, tuple[int, str]], int]:
    """Every run of :data:`LOADS`, the load of an unreadable checkpoint and a run saving into a directory that a
    live process (its pid returned) holds."""
    tmp, _ = saved
    broken = tmp / "broken"
    shutil.copytree(tmp / "ckpt-torch", broken)
    for path in broken.rglob("*.pt"):
        path.write_bytes(b"not a checkpoint")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp / "locked")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        env=run_env(),
    )  # fmt: skip
    runs = {
        f"load-{name}": ["--pipeline-schedule", schedule, "--ckpt-format", fmt, "--load", str(tmp / f"ckpt-{fmt}"),
                         "--ckpt-step", "2", *extra]
        for name, (fmt, schedule, extra, _) in LOADS.items()
    }  # fmt: skip
    runs["broken"] = ["--pipeline-schedule", "1f1b", "--ckpt-format", "torch", "--load", str(broken)]
    runs["locked"] = ["--pipeline-schedule", "1f1b", "--save", str(tmp / "locked"), "--save-interval", "1"]
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        return tmp, run_all(tmp, runs), holder.pid
    finally:
        holder.communicate("", timeout=60)


def _errors(log: str) -> list[str]:
    return [line for line in log.splitlines() if "megatron_pp_ext: error:" in line]


def _iterations(log: str) -> list[str]:
    return [line for line in log.splitlines() if " iteration " in line and "lm loss" in line]


@pytest.mark.gloo
@pytest.mark.parametrize("name", list(LOADS))
def test_checkpoint_loads_exactly_or_is_refused(
    saved: tuple[Path, list[float]], loaded: tuple[Path, dict[str, tuple[int, str]], int], name: str
) -> None:
    tmp, results, _ = loaded
    code, log = results[f"load-{name}"]
    _, schedule, _, expected = LOADS[name]
    moved = [line for line in log.splitlines() if "megatron_pp_ext: moved the weights" in line]
    if expected == "refused":
        assert code != 0, log[-4000:]
        errors = _errors(log)
        assert len(errors) == 1, log[-4000:]
        assert f"this --ckpt-format torch checkpoint (saved under {SAVED_UNDER})" in errors[0]
        assert f"does not fit the chunks of this run ({schedule})" in errors[0]
        assert "add --no-load-optim" in errors[0] and "--ckpt-format torch_dist" in errors[0]
        assert not _iterations(log) and "successfully loaded" not in log
        return
    assert code == 0, log[-4000:]
    assert "successfully loaded checkpoint" in log and not _errors(log), log[-4000:]
    assert len(moved) == (expected == "moved"), log[-4000:]
    iterations = _iterations(log)
    assert len(iterations) == 1 and "iteration        3/" in iterations[0], iterations
    assert losses(tmp, f"load-{name}", schedule) == saved[1]  # bitwise, every micro-batch


@pytest.mark.gloo
def test_unreadable_checkpoint_exits_non_zero(loaded: tuple[Path, dict[str, tuple[int, str]], int]) -> None:
    tmp, results, _ = loaded
    code, log = results["broken"]
    assert code != 0, log[-4000:]
    assert f"could not load the checkpoint from {tmp / 'broken'}" in log, log[-4000:]


@pytest.mark.gloo
def test_saving_into_a_directory_another_run_holds_is_refused(
    loaded: tuple[Path, dict[str, tuple[int, str]], int],
) -> None:
    tmp, results, holder = loaded
    code, log = results["locked"]
    assert code != 0, log[-4000:]
    errors = _errors(log)
    assert len(errors) == 1, log[-4000:]
    assert f"--save {tmp / 'locked'} is in use by another run (pid {holder} on host" in errors[0]
    assert not _iterations(log)
    assert not list((tmp / "locked").glob("iter_*"))  # nothing saved
