"""`megatron-pp grid --slurm`: the job script parses with bash and passes only flags the driver accepts."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from megatron_pp_ext.cli import main
from megatron_pp_ext.planner.driver_flags import driver_flags, flags_in_grid, unknown_flags
from megatron_pp_ext.planner.grid import DEFAULT_SCRIPT
from megatron_pp_ext.schedules import registry

FAST = ",".join(n for n in ("1f1b", "gpipe", "interleaved-1f1b", "zb-h1", "zb-h2", "zb-auto") if n in registry.names())


@pytest.fixture(scope="module")
def grids(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """A few grids covering TP / SP, virtual stages, uneven splits, recompute, memory limits,
    distributed optimizer, containers and venvs."""
    tmp_path = tmp_path_factory.mktemp("grids")
    plan = tmp_path / "plan.json"
    assert (
        main(
            [
                "plan",
                "--model",
                "zb-6.2b",
                "--gpus",
                "16",
                "--global-batch",
                "128",
                "--schedules",
                FAST,
                "--distributed-optimizer",
                "--schedule-memory-limits",
                "2p",
                "--tp",
                "1,2",
                "--pp",
                "2,4,8",
                "--save",
                str(plan),
                "--no-progress",
                "--no-cache",
                "--top",
                "1",
            ]
        )
        == 0
    )
    out = []
    a = tmp_path / "grid-a"
    assert (
        main(
            [
                "grid", "--slurm", "--plan", str(plan), "--out", str(a), "--top", "0", "--partition", "gpu",
                "--account", "proj-1", "--venv", "/opt/venv", "--setup", "module load cuda/12.4",
                "--env", "NCCL_SOCKET_IFNAME=ib0", "--time", "01:00:00", "--max-parallel", "4",
            ]
        )
        == 0
    )  # fmt: skip
    out.append(a)
    b = tmp_path / "grid-b"
    assert (
        main(
            [
                "grid", "--slurm", "--plan", str(plan), "--out", str(b), "--best-per-schedule",
                "--container", "nvcr.io/nvidia/pytorch:25.01-py3", "--container-mounts", "/work:/work",
                "--log-dir", str(tmp_path / "logs-b"), "--train-iters", "10", "--extra-args=--use-flash-attn",
            ]
        )
        == 0
    )  # fmt: skip
    out.append(b)
    return out


@pytest.mark.slow
def test_grid_writes_array_configs_and_plan(grids: list[Path]) -> None:
    a, b = grids
    sbatch = (a / "job.sbatch").read_text()
    configs = (a / "configs.tsv").read_text().splitlines()
    plan = json.loads((a / "plan.json").read_text())
    assert len(configs) - 1 == len(plan["rows"]) > 1
    assert f"#SBATCH --array=0-{len(configs) - 2}%4" in sbatch
    assert "#SBATCH --nodes=2" in sbatch and "#SBATCH --gpus-per-node=8" in sbatch
    assert "#SBATCH --partition=gpu" in sbatch and "#SBATCH --account=proj-1" in sbatch
    assert "CUDA_DEVICE_MAX_CONNECTIONS" in sbatch and "NCCL_SOCKET_IFNAME=ib0" in sbatch
    assert "source /opt/venv/bin/activate" in sbatch and "module load cuda/12.4" in sbatch
    assert "srun" in sbatch and "torchrun" in sbatch and "--rdzv-backend c10d" in sbatch
    assert 'SCRIPT="${MPP_SCRIPT:-$MPP_REPO/scripts/pretrain_gpt.py}"' in sbatch and str(DEFAULT_SCRIPT) not in sbatch
    assert "#SBATCH --cpus-per-task=64" in sbatch  # 8 per GPU unless --cpus-per-task
    flags = flags_in_grid(a)
    for flag in ("--log-throughput", "--timing-log-level", "--train-iters", "--pipeline-schedule", "--bf16"):
        assert flag in flags
    assert "--use-distributed-optimizer" in flags
    header = configs[0].split("\t")
    first = dict(zip(header, configs[1].split("\t"), strict=True))
    assert first["id"] == plan["rows"][0]["id"] and "--pipeline-schedule" in first["args"]
    b_text = (b / "job.sbatch").read_text()
    assert 'CONTAINER="${MPP_CONTAINER:-nvcr.io/nvidia/pytorch:25.01-py3}"' in b_text
    assert str(b.parent / "logs-b") in b_text and "--use-flash-attn" in b_text
    best = [(r["schedule"], r["memory_limit"]) for r in json.loads((b / "plan.json").read_text())["rows"]]
    assert len(best) == len(set(best)) > 1


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.slow
def test_every_sbatch_passes_bash_n(grids: list[Path]) -> None:
    for grid in grids:
        proc = subprocess.run(["bash", "-n", str(grid / "job.sbatch")], capture_output=True, text=True, check=False)
        assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_sbatch_picks_its_line_and_runs_the_driver(grids: list[Path], tmp_path: Path) -> None:
    """Run the job script with srun / scontrol / torchrun stubbed: task 1 must start the driver
    with the common flags and configuration 1's flags, and log the exit code."""
    grid = grids[0]
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "scontrol").write_text("#!/bin/bash\necho node001\n")
    (stubs / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    (stubs / "torchrun").write_text('#!/bin/bash\necho "TORCHRUN $*"\nexit 0\n')
    for f in stubs.iterdir():
        f.chmod(0o755)
    env = {"PATH": f"{stubs}:/usr/bin:/bin", "SLURM_ARRAY_TASK_ID": "1", "SLURM_JOB_NODELIST": "node001",
           "SLURM_NNODES": "2", "SLURM_ARRAY_JOB_ID": "77"}  # fmt: skip
    text = (grid / "job.sbatch").read_text().replace("source /opt/venv/bin/activate", ":").replace("module load", ":")
    script = tmp_path / "job-test.sbatch"
    script.write_text(text)
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    row = (grid / "configs.tsv").read_text().splitlines()[2].split("\t")
    log = (grid / "logs" / f"{row[1]}.log").read_text()
    assert log.startswith(f"# megatron-pp config {row[1]}")
    assert "--nnodes 2 --nproc-per-node 8" in log and "--rdzv-endpoint node001:29501" in log
    assert row[2] in log and "--log-throughput" in log
    assert log.rstrip().endswith("# megatron-pp exit code 0")


@pytest.mark.skipif(importlib.util.find_spec("megatron.training") is None, reason="megatron-core not installed")
@pytest.mark.slow
def test_sbatch_flags_are_accepted_by_pretrain_gpt(grids: list[Path]) -> None:
    """Static check of every flag a grid passes against `scripts/pretrain_gpt.py --help` (falls
    back to the driver's own parser -- megatron's plus the plugin's -- when --help cannot print:
    megatron-core 0.19.2's help formatting fails on a '%' in one of its own help strings)."""
    known, how = driver_flags(DEFAULT_SCRIPT)
    assert "--pipeline-schedule" in known and "--num-layers" in known, how
    for grid in grids:
        assert unknown_flags(grid, known) == [], (grid, how)
