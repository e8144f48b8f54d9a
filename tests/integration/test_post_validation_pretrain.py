"""``--pipeline-post-validation`` under megatron's own training loop (scripts/pretrain_gpt.py, gloo, CPU).

Late validation (the default) runs iteration k+1's forward-backward on the eagerly stepped weights, then
validates step k and, when that changed some stage's weights, runs the forward-backward again. With
clipping that the first stage's partial norm does not see (rollbacks), a decaying learning rate (a redone
step must use its own) and dropout (a re-run must draw the same masks), every micro-batch's loss, megatron's
logged loss and grad norm, and every weight after training must be bitwise those of the synchronous run
(at p >= 3 the last step's weights within its derived rounding, :func:`_within_last_step_rounding`).
Rank 0 must start iteration k+1's first forward before it receives step k's complete state; early validation
(``--pipeline-post-validation-early``) does not, and the order check must say so.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from warm_launch import launch, run_env

ITERS = 4
LOG_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ .*lm loss: ([0-9.E+-]+) .*grad norm: ([0-9.]+)")
SUMMARY = re.compile(
    # [^>]*?: one rank's summary, even when another rank's line was written into the middle of it
    r"post-validation, pipeline stage (\d+): [^>]*? (\d+) rollbacks, (\d+) redone, (\d+) forward-backward re-runs"
)


def flags(p: int) -> list[str]:
    return [
        "--cpu", "--pipeline-schedule", "zb-h1", "--pipeline-model-parallel-size", str(p),
        "--num-layers", str(2 * p), "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32",
        "--micro-batch-size", "2", "--global-batch-size", str(4 * p),
        "--train-iters", str(ITERS), "--lr", "1e-3", "--lr-warmup-iters", "1",
        "--lr-decay-style", "linear", "--lr-decay-iters", str(ITERS), "--min-lr", "1e-4",
        # between stage 0's partial norm and the complete one in some iterations (rollback, then re-run)
        "--clip-grad", "1.0" if p == 2 else "0.8",
        "--eval-interval", "1000", "--eval-iters", "0", "--log-interval", "1", "--num-workers", "0",
    ]  # fmt: skip


def start(tmp: Path, name: str, p: int, extra: list[str]) -> tuple[Any, Path]:
    env = run_env(
        MEGATRON_PP_EXT_LOSS_FILE=str(tmp / f"{name}.loss"),
        MEGATRON_PP_EXT_WEIGHTS_FILE=str(tmp / f"{name}.weights"),
        MEGATRON_PP_EXT_POST_VALIDATION_LOG=str(tmp / f"{name}.pv"),
    )
    return launch(tmp, name, [*flags(p), *extra], nproc=p, env=env)


def run_all(tmp: Path, p: int, runs: dict[str, list[str]]) -> dict[str, str]:
    started = {name: start(tmp, name, p, extra) for name, extra in runs.items()}
    logs = {}
    for name, (proc, log) in started.items():
        try:
            code = proc.wait(timeout=300)
        except subprocess.TimeoutExpired:
            for other, _ in started.values():
                if other.poll() is None:
                    os.killpg(other.pid, signal.SIGKILL)
            raise
        logs[name] = log.read_text()
        assert code == 0, f"{name} run failed:\n{logs[name][-4000:]}"
    return logs


def losses(tmp: Path, name: str) -> list[str]:
    files = sorted(tmp.glob(f"{name}.loss.rank*"))
    assert len(files) == 1, files
    return files[0].read_text().split()


def weights(tmp: Path, name: str, p: int) -> dict[str, object]:
    import torch

    out = {}
    for rank in range(p):
        for key, value in torch.load(tmp / f"{name}.weights.rank{rank}").items():
            out[f"{rank}:{key}"] = value
    return out


def forward_before_complete_state(events: list[list[object]]) -> list[str]:
    """Rank 0's events (integration/post_validation_training.py EVENTS): after each step, the first forward of
    the next forward-backward must come before the complete state of that step is received. Returns what
    breaks this (empty: every iteration started without waiting for the complete state)."""
    problems = []
    steps = [i for i, (kind, _) in enumerate(events) if kind == "step"]
    for n, at in enumerate(steps):
        later = events[at + 1 :]
        kinds = [kind for kind, _ in later]
        if "received" not in kinds or "forward" not in kinds:  # the last step: validated when train() returns
            continue
        if kinds.index("received") < kinds.index("forward"):
            problems.append(f"step {n + 1}: complete state received before the next forward")
    return problems


ADAM_UPDATE_BOUND = (1 - 0.9) / (1 - 0.999) ** 0.5  # (1 - beta1) / sqrt(1 - beta2), megatron's default betas
LR_MAX = 1e-3  # flags(): --lr, the largest rate of the decaying schedule


def _within_last_step_rounding(want: object, got: object) -> bool:
    """Weights after the last step, element by element: within one float32 spacing of the weight plus what a
    last-bit difference of the clip coefficient can move one Adam step.

    Why not bitwise at p >= 3: megatron all-reduces the stages' partial squared norms in the backend's order,
    post-validation adds them in pipeline order; with three or more terms the two float32 sums may differ in
    the last bit (which depends on the CPU's kernels: equal under AVX-512 here, not under AVX2). Every
    micro-batch loss is compared bitwise above, so the weights before the last step are bitwise equal; the
    last step's clip coefficients then differ by ``delta <= 2^-22`` relative, and Adam's update
    ``m / (sqrt(v) + eps)`` (at most ``(1 - beta1) / sqrt(1 - beta2)`` in size) by at most ``delta`` of
    itself, so a weight moves by at most ``lr * 2^-22 * ADAM_UPDATE_BOUND`` more in one run, plus the
    rounding of the subtraction (one spacing). A rollback or redo gone wrong moves a weight by a whole update,
    ``~lr``: 1e4 times more."""
    import torch

    assert isinstance(want, torch.Tensor) and isinstance(got, torch.Tensor)
    spacing = (torch.nextafter(want, torch.full_like(want, float("inf"))) - want).abs()
    allowed = spacing + LR_MAX * 2.0**-22 * ADAM_UPDATE_BOUND
    return bool(((want - got).abs() <= allowed).all())


def post_validation_log(tmp: Path, name: str, rank: int) -> dict[str, object]:
    return json.loads((tmp / f"{name}.pv.rank{rank}").read_text())


@pytest.mark.gloo
@pytest.mark.parametrize("p", [2, 4])
def test_late_post_validation_in_pretrain_matches_synchronous_bitwise(tmp_path: Path, p: int) -> None:
    logs = run_all(tmp_path, p, {"sync": [], "late": ["--pipeline-post-validation"]})
    assert "optimizer post-validation on" in logs["late"]
    logged = {name: LOG_LINE.findall(text) for name, text in logs.items()}
    assert [int(x[0]) for x in logged["sync"]] == list(range(1, ITERS + 1))
    assert logged["late"] == logged["sync"]  # megatron's logged loss and grad norm
    assert len(losses(tmp_path, "sync")) == ITERS * 2 * p  # global batch 4p, micro-batch 2
    assert losses(tmp_path, "late") == losses(tmp_path, "sync")  # every micro-batch, bitwise
    want, got = weights(tmp_path, "sync", p), weights(tmp_path, "late", p)
    assert want.keys() == got.keys()
    import torch

    if p == 2:  # two partial norms: the same float32 sum in either order, so the same clip coefficient
        assert [k for k in want if not torch.equal(want[k], got[k])] == []
    else:
        assert [k for k in want if not _within_last_step_rounding(want[k], got[k])] == []
    # rollbacks and re-runs happened (clip 1.0: the complete norm clips, stage 0's partial one does not)
    summary = {int(s): (int(rb), int(rd), int(rr)) for s, rb, rd, rr in SUMMARY.findall(logs["late"])}
    assert sorted(summary) == list(range(p)), logs["late"][-3000:]
    assert summary[0][0] > 0 and summary[0][1] > 0, summary
    reruns = {rr for _, _, rr in summary.values()}
    assert len(reruns) == 1 and reruns.pop() > 0, summary  # every stage re-ran the same iterations
    stage0 = post_validation_log(tmp_path, "late", 0)
    assert stage0["stages"][0]["rollbacks"] == summary[0][0]
    assert forward_before_complete_state(stage0["events"]) == []
    # no loss scaler or skip threshold: train_step's post-step reductions stay within the stage (3 per step)
    assert stage0["stage_local_reductions"] >= 3 * ITERS, stage0["stage_local_reductions"]


@pytest.mark.gloo
def test_early_post_validation_waits_for_the_complete_state(tmp_path: Path) -> None:
    """``--pipeline-post-validation-early``: exact as well, no re-run, but rank 0 receives step k's complete
    state before iteration k+1's first forward, which the order check reports."""
    logs = run_all(
        tmp_path, 2, {"sync": [], "early": ["--pipeline-post-validation", "--pipeline-post-validation-early"]}
    )
    assert losses(tmp_path, "early") == losses(tmp_path, "sync")
    summary = {int(s): (int(rb), int(rd), int(rr)) for s, rb, rd, rr in SUMMARY.findall(logs["early"])}
    assert summary[0][0] > 0 and all(rr == 0 for _, _, rr in summary.values()), summary
    problems = forward_before_complete_state(post_validation_log(tmp_path, "early", 0)["events"])
    assert len(problems) == ITERS - 1, problems
