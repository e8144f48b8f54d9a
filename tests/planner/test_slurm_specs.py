"""The provided Slurm scripts (scripts/slurm/NAME/job.sbatch): generated from their checked-in plan
specifications, free of the planning machine's paths, valid bash, runnable under stubbed srun /
torchrun, and their logs collect into the papers' tables."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from megatron_pp_ext.cli import main
from megatron_pp_ext.planner.memo import PlannerMemo
from megatron_pp_ext.planner.specs import load_spec, spec_files, write_spec_grid

REPO = Path(__file__).resolve().parents[2]
SPECS = spec_files()
NAMES = [p.stem for p in SPECS]
FILES = ("job.sbatch", "configs.tsv", "plan.json")


def test_every_published_grid_has_a_spec() -> None:
    for name in (
        "zb-1.5b",
        "zb-6.2b",
        "zb-14.6b",
        "zb-28.3b",
        "cm-98.5b",
        "bf-52b",
        "bf-6.6b",
        "bitpipe-14.6b",
        "zeropp-6.2b",
    ):
        assert name in NAMES


@pytest.fixture(scope="module")
def memo() -> PlannerMemo:
    """One planner memo for every spec of this module: a schedule several specs (or global batches) plan is
    built, validated and compiled once (the plans are what each spec alone produces)."""
    return PlannerMemo()


@pytest.fixture(scope="module")
def schedule_cache(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The planner's disk cache of slow generators (v-zb, zb-auto with costs) in pytest's cache directory,
    keyed by the schedules package's source: a changed generator is run again. Without the cache plugin
    (``-p no:cacheprovider``, as scripts/run_tests.sh runs) a fresh directory for this module."""
    cache = getattr(request.config, "cache", None)
    if cache is None:
        return tmp_path_factory.mktemp("megatron-pp-schedules")
    return Path(cache.mkdir("megatron-pp-schedules"))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.slow
def test_checked_in_script_is_what_the_generator_writes(
    name: str, tmp_path: Path, memo: PlannerMemo, schedule_cache: Path
) -> None:
    """Regenerate from the spec into a scratch checkout: every file must be byte-identical
    (`bash scripts/slurm/regenerate.sh` after changing the planner or a spec)."""
    spec = load_spec(REPO / "scripts" / "slurm" / "specs" / f"{name}.json")
    write_spec_grid(spec, tmp_path, memo=memo, cache_dir=schedule_cache)
    for file in FILES:
        fresh = (tmp_path / spec.out / file).read_text()
        checked_in = REPO / spec.out / file
        assert checked_in.is_file(), f"{checked_in} missing: run scripts/slurm/regenerate.sh"
        assert fresh == checked_in.read_text(), f"{spec.out}/{file} is stale: run scripts/slurm/regenerate.sh"


@pytest.mark.parametrize("name", NAMES)
def test_provided_script_is_portable_and_parses(name: str) -> None:
    spec = load_spec(REPO / "scripts" / "slurm" / "specs" / f"{name}.json")
    text = (REPO / spec.out / "job.sbatch").read_text()
    for file in FILES:
        assert str(REPO) not in (REPO / spec.out / file).read_text(), f"{file} has a path of the planning machine"
    assert "#SBATCH --cpus-per-task=" in text and '--cpus-per-task="${SLURM_CPUS_PER_TASK' in text
    assert "sbatch --partition=PART --account=ACCT" in text and "MPP_CONTAINER" in text
    assert spec.reproduces[0] in text and "CUDA_DEVICE_MAX_CONNECTIONS" in text
    proc = subprocess.run(["bash", "-n", str(REPO / spec.out / "job.sbatch")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


FAKE_TORCHRUN = r"""#!/bin/bash
# Stands in for torchrun + megatron: records its arguments and prints megatron's log lines.
echo "TORCHRUN $*"
for i in 1 2 3 4; do
  echo " [2026-01-01] iteration        $i/       4 | consumed samples: 1 | elapsed time per iteration (ms): 1000.0 | \
throughput per GPU (TFLOP/s/GPU): 150.0 | global batch size:   192 | lm loss: 9.0E+00 | \
number of skipped iterations:   0 | number of nan iterations:   0 |"
done
echo "[Rank 0] (after 2 iterations) memory (MB) | allocated: 1000.0 | max allocated: 20480.0 | \
reserved: 1.0 | max reserved: 1.0"
echo "[after training is done] datetime: 2026-01-01 00:00:00"
"""


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_provided_script_runs_under_stubbed_slurm_and_collects(tmp_path: Path) -> None:
    """Every array task of the 1.5B zero-bubble script under stubbed scontrol / srun / torchrun,
    submitted from the checkout with logs redirected: each starts the checkout's driver with its
    configuration; then `collect` writes the paper table and plot."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    (stubs / "scontrol").write_text("#!/bin/bash\necho node001\n")
    (stubs / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do echo "SRUN $1"; shift; done\nexec "$@"\n')
    (stubs / "torchrun").write_text(FAKE_TORCHRUN)
    for f in stubs.iterdir():
        f.chmod(0o755)
    spec = load_spec(REPO / "scripts" / "slurm" / "specs" / "zb-1.5b.json")
    grid = REPO / spec.out
    tasks = len((grid / "configs.tsv").read_text().splitlines()) - 1
    logs = tmp_path / "logs"
    for task in range(tasks):
        env = {"PATH": f"{stubs}:/usr/bin:/bin", "SLURM_ARRAY_TASK_ID": str(task), "SLURM_JOB_NODELIST": "node001",
               "SLURM_NNODES": "1", "SLURM_ARRAY_JOB_ID": "77", "SLURM_SUBMIT_DIR": str(REPO),
               "SLURM_CPUS_PER_TASK": "32", "MPP_LOG_DIR": str(logs), "MPP_CONTAINER": "img:1"}  # fmt: skip
        proc = subprocess.run(["bash", str(grid / "job.sbatch")], capture_output=True, text=True, env=env, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
    row = (grid / "configs.tsv").read_text().splitlines()[1].split("\t")
    log = (logs / f"{row[1]}.log").read_text()
    assert f"{REPO}/scripts/pretrain_gpt.py" in log and row[2] in log
    assert "SRUN --cpus-per-task=32" in log and "SRUN --container-image=img:1" in log
    assert (logs / "plan.json").is_file()
    assert main(["collect", str(logs)]) == 0
    paper = (logs / "paper.md").read_text()
    assert "| zb-h1 |" in paper and "| 1f1b |" in paper and "B=192 samples/GPU/s" in paper
    # measured 192 samples / 1 s / 8 GPUs = 24 per GPU; MFU 150 / 312
    assert "24.000 (" in paper and "48.1% (" in paper and "20.0 (" in paper
    assert (logs / "paper.png").is_file()
    # several scripts (model sizes) into one table: a section per log directory
    shutil.copytree(logs, tmp_path / "logs2")
    assert main(["collect", str(logs), str(tmp_path / "logs2"), "--no-plot"]) == 2  # needs --out
    assert main(["collect", str(logs), str(tmp_path / "logs2"), "--out", str(tmp_path / "all"), "--no-plot"]) == 0
    combined = (tmp_path / "all" / "paper.md").read_text()
    assert combined.count("## zb-1.5b on 8 GPUs") == 2 and combined.count("| zb-h1 |") == 2


def test_collect_fails_when_every_configuration_is_missing(tmp_path: Path) -> None:
    """A log directory holding only the plan (every array task failed before writing its log)."""
    spec = load_spec(REPO / "scripts" / "slurm" / "specs" / "zb-1.5b.json")
    (tmp_path / "plan.json").write_text((REPO / spec.out / "plan.json").read_text())
    assert main(["collect", str(tmp_path), "--no-plot"]) == 1


def test_submitting_from_another_directory_says_so(tmp_path: Path) -> None:
    """The paths are relative to the submission directory: from elsewhere the script stops with one
    line naming the fix (or runs with MPP_GRID_DIR), instead of awk's error and an empty configuration."""
    script = REPO / "scripts" / "slurm" / "zb-1.5b" / "job.sbatch"
    env = {"PATH": "/usr/bin:/bin", "SLURM_ARRAY_TASK_ID": "0", "SLURM_SUBMIT_DIR": str(tmp_path)}
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 2 and "set MPP_GRID_DIR" in proc.stderr, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
