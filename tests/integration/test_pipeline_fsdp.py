"""``--pipeline-fsdp``: megatron's ``pretrain()`` trains with per-chunk FSDP; bad flag combinations are refused.

The training run is docs/megatron.md's (bfs, PP=2 x DP=2 on 4 CPU ranks, FSDP) cut to 4 iterations: megatron's
logged loss must fall and match the same command without ``--pipeline-fsdp`` (plain megatron DDP, measured
on this pinned environment: the values below) to 1e-5 relative (measured: equal in all 7 logged digits).
The refusals are checked on the plugin's validation (one line, exit 2, naming the flag) and through the
real script for two of them (megatron's own parser in front).
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from megatron_args_helpers import make_args
from warm_launch import launch, run_env

from megatron_pp_ext.integration.arguments import validate_arguments, validate_arguments_or_exit
from megatron_pp_ext.integration.features.chunk_fsdp import check_argv

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "pretrain_gpt.py"
FLAGS = [
    "--pipeline-schedule", "bfs", "--cpu", "--pipeline-model-parallel-size", "2",
    "--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4",
    "--seq-length", "64", "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "16",
    "--lr", "3e-3", "--lr-decay-style", "constant", "--eval-iters", "0", "--log-interval", "1", "--num-workers", "0",
]  # fmt: skip
LOG_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ .*lm loss: ([0-9.E+-]+) .*grad norm: ([0-9.]+)")
GOOD = ["--pipeline-schedule", "bfs", "--pipeline-fsdp"]
UNTIED = {"untie_embeddings_and_output_weights": True}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- refusals (the plugin's validation, no megatron) ------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "megatron", "flag"),
    [
        (["--pipeline-fsdp"], UNTIED, "--pipeline-fsdp"),  # no schedule
        (GOOD, {}, "--pipeline-fsdp"),  # tied embeddings (megatron's default)
        (GOOD, {**UNTIED, "use_distributed_optimizer": True}, "--use-distributed-optimizer"),
        (GOOD, {**UNTIED, "use_torch_fsdp2": True}, "--use-torch-fsdp2"),
        (GOOD, {**UNTIED, "use_megatron_fsdp": True}, "--use-megatron-fsdp"),
        (GOOD, {**UNTIED, "save": "/tmp/ckpt"}, "--save"),
        (GOOD, {**UNTIED, "tensor_model_parallel_size": 2}, "--tensor-model-parallel-size"),
        ([*GOOD, "--pipeline-fsdp-max-unsharded", "0"], UNTIED,
         "--pipeline-fsdp-max-unsharded"),
        (["--pipeline-schedule", "bfs", "--pipeline-fsdp-max-unsharded", "2"], {}, "--pipeline-fsdp-max-unsharded"),
    ],
)  # fmt: skip
def test_bad_combination_is_one_line_and_exit_2(argv, megatron, flag, capsys):
    with pytest.raises(SystemExit) as info:
        validate_arguments_or_exit(make_args(argv, **megatron), prog="pretrain_gpt.py")
    assert info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"pretrain_gpt.py: error: argument {flag}: "), err


def test_tied_embedding_refusal_names_the_flag_to_add():
    with pytest.raises(ValueError, match="add --untie-embeddings-and-output-weights"):
        validate_arguments(make_args(GOOD))


def test_good_combination_sets_the_config():
    config = validate_arguments(
        make_args([*GOOD, "--pipeline-fsdp-max-unsharded", "2"], untie_embeddings_and_output_weights=True)
    )
    assert config.fsdp and config.fsdp_max_unsharded == 2


def test_megatrons_fsdp_flags_are_refused_before_megatron_parses():
    check_argv(["--use-torch-fsdp2"])  # without --pipeline-fsdp: megatron's business
    for flag in ("--use-torch-fsdp2", "--use-megatron-fsdp"):
        with pytest.raises(ValueError, match=f"argument {flag}: not allowed with --pipeline-fsdp"):
            check_argv(["--pipeline-fsdp", flag])


@pytest.mark.gloo
def test_script_refuses_with_one_line(tmp_path: Path) -> None:
    """Through scripts/pretrain_gpt.py (megatron's parser in front), before any process group."""
    env = {**run_env(), "WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0"}  # what torchrun would set; no rendezvous
    cases = {
        "--pipeline-fsdp": [],  # tied embeddings: after megatron's validation
        "--use-torch-fsdp2": ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"],  # before it
    }
    procs = {
        flag: subprocess.Popen(
            [sys.executable, str(SCRIPT), *FLAGS, "--pipeline-fsdp", "--train-iters", "2", *extra],
            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )
        for flag, extra in cases.items()
    }  # fmt: skip
    for flag, proc in procs.items():
        _, err = proc.communicate(timeout=180)
        errors = [line for line in err.splitlines() if "error" in line.lower()]
        assert proc.returncode == 2, err[-3000:]
        assert len(errors) == 1 and errors[0].startswith(f"pretrain_gpt.py: error: argument {flag}: "), err[-3000:]
        assert "Traceback" not in err


# ---- the training run ---------------------------------------------------------------------------------
def _train(tmp_path: Path, name: str, iters: int, *extra: str) -> tuple[list[float], str]:
    flags = [*FLAGS, "--train-iters", str(iters), "--untie-embeddings-and-output-weights", *extra]
    proc, log = launch(tmp_path, name, flags, nproc=4)
    try:
        code = proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    text = log.read_text()
    assert code == 0, text[-4000:]
    logged = [(int(i), float(loss)) for i, loss, _ in LOG_LINE.findall(text)]
    assert [i for i, _ in logged] == list(range(1, iters + 1)), text[-3000:]
    return [loss for _, loss in logged], text


@pytest.mark.gloo
def test_bfs_fsdp_pretrain_loss_falls_and_matches_ddp(tmp_path: Path) -> None:
    """The same command with plain megatron DDP, run here too, gives the same logged losses."""
    iters = 4
    losses, text = _train(tmp_path, "fsdp", iters, "--pipeline-fsdp")
    assert "--pipeline-fsdp: 2 chunk(s) per rank sharded over 2 data-parallel rank(s)" in text
    assert losses[-1] < losses[0]
    ddp_losses, _ = _train(tmp_path, "ddp", iters)
    assert losses == pytest.approx(ddp_losses, rel=1e-5)


# ---- the optimizer on shards (one process) -------------------------------------------------------------
@pytest.mark.gloo  # one gloo rank, in this process
def test_sharded_adamw_steps_like_megatrons_torch_adamw(megatron, monkeypatch):
    """Two ShardedAdamW steps = torch's AdamW over megatron's two groups (no decay for biases and 1-D
    parameters) after megatron's clipping, on one gloo rank."""
    import copy
    from types import SimpleNamespace

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_pp_ext.integration.fsdp_training import ShardedAdamW
    from megatron_pp_ext.runtime.fsdp import ShardedChunk

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_group", lambda: dist.group.WORLD)
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3), torch.nn.Linear(3, 2))
        reference = copy.deepcopy(module)
        chunk = ShardedChunk(module, dist.group.WORLD)
        config = SimpleNamespace(
            lr=0.1, min_lr=0.0, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8,
            clip_grad=0.05, log_num_zeros_in_grad=False, decoupled_weight_decay=True,
        )  # fmt: skip
        optimizer = ShardedAdamW(config, [chunk])
        no_decay = [p for n, p in reference.named_parameters() if n.endswith(".bias") or p.dim() == 1]
        decay = [p for p in reference.parameters() if all(p is not q for q in no_decay)]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
        torch_adamw = torch.optim.AdamW(groups, lr=0.1, betas=(0.9, 0.999), eps=1e-8)
        for step in range(2):
            x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
            chunk.start_iteration()
            chunk.unshard()
            chunk(x).square().sum().backward()
            chunk.reshard()
            chunk.start_grad_reduce()
            chunk.finish_grad_reduce()
            _, norm, _ = optimizer.step()
            torch_adamw.zero_grad()
            reference(x).square().sum().backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), config.clip_grad)
            torch_adamw.step()
            assert norm == pytest.approx(float(ref_norm), rel=1e-6), step
            optimizer.zero_grad()
        full = chunk.gather_full_params()
        for name, p in reference.named_parameters():
            torch.testing.assert_close(full[name], p.detach(), rtol=0, atol=1e-6, msg=name)
    finally:
        dist.destroy_process_group()


@pytest.mark.gloo
def test_zeropp_fsdp_pretrain_reduces_per_unit_and_matches_ddp(tmp_path: Path) -> None:
    """zeropp under megatron's pretrain() with --pipeline-fsdp: the schedule megatron's flags build declares
    the per-unit gradient reduce-scatter the executor derives for FSDP chunks (m = 4, U = 2: two per chunk,
    four per rank); trained that way, the losses equal plain megatron DDP's (one all-reduce per chunk)."""
    from megatron_pp_ext.schedules.collectives import CollectiveKind, derive_collectives, fsdp_policy

    iters = 3
    zeropp = ["--pipeline-schedule", "zeropp", "--pipeline-unit-size", "2"]  # the last --pipeline-schedule wins
    schedule = validate_arguments(make_args([*zeropp, "--pipeline-fsdp"], **UNTIED)).build(2, 4)
    plan = derive_collectives(schedule, fsdp_policy(schedule))
    assert [plan.count(CollectiveKind.REDUCE_GRADS, r) for r in range(2)] == [4, 4]
    losses, text = _train(tmp_path, "zeropp-fsdp", iters, *zeropp, "--pipeline-fsdp")
    assert "--pipeline-fsdp: 2 chunk(s) per rank sharded over 2 data-parallel rank(s)" in text
    ddp_losses, _ = _train(tmp_path, "zeropp-ddp", iters, *zeropp)
    assert losses == pytest.approx(ddp_losses, rel=1e-5)
