"""The Slurm array job ``megatron-pp grid --slurm`` writes (``job.sbatch``), from one template.

:data:`TEMPLATE` is the script as it runs, with ``@@{name}`` where a value of the grid goes (the bash
text keeps its own ``$`` and ``${...}``); :func:`sbatch_text` checks every value that reaches the
script and fills it in. Task ``i`` of the array reads line ``i`` of ``configs.tsv`` and runs
``srun torchrun ... scripts/pretrain_gpt.py COMMON_ARGS CONFIG_ARGS`` on every node of the allocation
(c10d rendezvous on the first node), writing ``LOGDIR/<config id>.log`` (first line: the config id;
last line: the exit code), which ``megatron-pp collect LOGDIR`` reads.
"""

from __future__ import annotations

import re
import shlex
import string
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_ENV", "TEMPLATE", "GridOptions", "check_tokens", "sbatch_text"]

# | : a layer layout; * : a hybrid layer pattern's attention (read -a neither globs nor interprets them, and the
# script expands the words quoted)
_SAFE_TOKEN = re.compile(r"^[A-Za-z0-9_.,@=:/+%|*-]+$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
DEFAULT_ENV = {
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",  # megatron: keeps TP/SP communication ordered with compute
    "NCCL_DEBUG": "WARN",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    "NCCL_IB_TIMEOUT": "22",
    "OMP_NUM_THREADS": "8",
    "PYTHONUNBUFFERED": "1",
}


@dataclass
class GridOptions:
    """Cluster side of a grid (everything not in the plan)."""

    nodes: int | None = None  # default: ceil(GPUs / gpus_per_node)
    gpus_per_node: int = 8
    partition: str | None = None
    account: str | None = None
    time: str = "00:30:00"
    qos: str | None = None
    cpus_per_task: int | None = None
    container: str | None = None  # pyxis/enroot image (srun --container-image)
    container_mounts: str | None = None
    venv: str | None = None  # a virtualenv / conda prefix to activate (PATH/bin/activate)
    setup: list[str] = field(default_factory=list)  # shell lines run before srun (module load ...)
    log_dir: str | None = None  # default: OUT/logs
    train_iters: int = 20
    max_parallel: int | None = None  # array throttle (%N)
    script: str | None = None  # default: $MPP_REPO/scripts/pretrain_gpt.py (pretrain_hybrid.py: hybrid model)
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    job_name: str | None = None
    base_dir: str | None = None  # paths in the script are relative to this (the submission directory); default cwd
    about: list[str] = field(default_factory=list)  # header lines: what the script reproduces


class _ScriptTemplate(string.Template):
    delimiter = "@@"  # the bash text keeps its own $ and ${...}


# `@@{about}`, `@@{sbatch_options}`, `@@{setup}` and `@@{exports}` are whole lines (each ending in a newline,
# or nothing), the other fields parts of a line.
TEMPLATE = _ScriptTemplate(
    r"""#!/bin/bash
# megatron-pp grid: @@{count} configuration(s) of @@{model} on @@{gpus} GPUs (@@{nodes} node(s) x @@{nproc}); one configuration per array task.
@@{about}#
# Submit from the directory the paths below are relative to (a checkout of megatron_pp_ext):
#   sbatch @@{out}/job.sbatch
# Cluster settings: sbatch's own flags override the #SBATCH lines, e.g.
#   sbatch --partition=PART --account=ACCT --time=01:00:00 @@{out}/job.sbatch
# Environment (read at run time; sbatch passes your environment on):
#   MPP_REPO            megatron_pp_ext checkout on the cluster (default: the submission directory)
#   MPP_GRID_DIR        directory holding configs.tsv and plan.json (default below)
#   MPP_SCRIPT          training driver (default: $MPP_REPO/scripts/pretrain_gpt.py)
#   MPP_LOG_DIR         where each configuration's log goes (default below)
#   MPP_VENV            virtualenv / conda prefix to activate (PREFIX/bin/activate)
#   MPP_CONTAINER       container image for srun --container-image (pyxis/enroot), MPP_CONTAINER_MOUNTS
#   MPP_SETUP           a shell line run before srun (e.g. 'module load cuda/12.4')
# Collect: megatron-pp collect @@{log_dir}
#SBATCH --job-name=@@{job_name}
#SBATCH --nodes=@@{nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=@@{nproc}
#SBATCH --cpus-per-task=@@{cpus}
#SBATCH --exclusive
#SBATCH --time=@@{time}
#SBATCH --array=@@{array}
#SBATCH --output=slurm-%x-%A_%a.out
@@{sbatch_options}
set -euo pipefail

SUBMIT_DIR="${SLURM_SUBMIT_DIR:-$PWD}"
MPP_REPO="${MPP_REPO:-$SUBMIT_DIR}"
GRID_DIR="${MPP_GRID_DIR:-@@{grid_dir}}"
LOG_DIR="${MPP_LOG_DIR:-@@{log_dir_path}}"
SCRIPT="${MPP_SCRIPT:-@@{script}}"
CONFIGS="$GRID_DIR/configs.tsv"
if [ ! -f "$CONFIGS" ]; then
  echo "$CONFIGS not found: submit from the directory this script's paths are relative to," \
    "or set MPP_GRID_DIR to the directory holding configs.tsv" >&2
  exit 2
fi
NPROC_PER_NODE=@@{nproc}
mkdir -p "$LOG_DIR"
[ -e "$LOG_DIR/plan.json" ] || cp "$GRID_DIR/plan.json" "$LOG_DIR/plan.json" 2>/dev/null || true

# ---- environment ----
if [ -n "${MPP_VENV:-}" ]; then source "$MPP_VENV/bin/activate"; fi
@@{setup}if [ -n "${MPP_SETUP:-}" ]; then eval "$MPP_SETUP"; fi
@@{exports}export PYTHONPATH="$MPP_REPO${PYTHONPATH:+:$PYTHONPATH}"

# ---- this task's configuration ----
TASK="${SLURM_ARRAY_TASK_ID:?submit with sbatch: this is a job array}"
LINE=$(awk -F'\t' -v task="$TASK" 'NR > 1 && $1 == task' "$CONFIGS")
if [ -z "$LINE" ]; then echo "no configuration $TASK in $CONFIGS" >&2; exit 2; fi
CONFIG_ID=$(printf '%s\n' "$LINE" | cut -f2)
CONFIG_ARGS_TEXT=$(printf '%s\n' "$LINE" | cut -f3)
read -r -a CONFIG_ARGS <<< "$CONFIG_ARGS_TEXT"

# Shared by every configuration: model, precision, mock data, fixed iterations, logs.
@@{common_args}

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
MASTER_PORT=$((29500 + TASK % 1000))
LOG="$LOG_DIR/$CONFIG_ID.log"
{
  echo "# megatron-pp config $CONFIG_ID (array task $TASK of job ${SLURM_ARRAY_JOB_ID:-?}, nodes $SLURM_JOB_NODELIST)"
  echo "# args: ${COMMON_ARGS[*]} ${CONFIG_ARGS[*]}"
} > "$LOG"

# srun does not inherit --cpus-per-task from sbatch (Slurm >= 22.05): pass it on.
SRUN_ARGS=(--kill-on-bad-exit=1 --ntasks-per-node=1 --cpus-per-task="${SLURM_CPUS_PER_TASK:-@@{cpus}}")
CONTAINER="${MPP_CONTAINER:-@@{container}}"
CONTAINER_MOUNTS="${MPP_CONTAINER_MOUNTS:-@@{container_mounts}}"
if [ -n "$CONTAINER" ]; then
  SRUN_ARGS+=(--container-image="$CONTAINER" --container-workdir="$SUBMIT_DIR")
  if [ -n "$CONTAINER_MOUNTS" ]; then SRUN_ARGS+=(--container-mounts="$CONTAINER_MOUNTS"); fi
fi

RC=0
srun "${SRUN_ARGS[@]}" \
  torchrun --nnodes "$SLURM_NNODES" --nproc-per-node "$NPROC_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${SLURM_ARRAY_JOB_ID:-0}_$TASK" \
    "$SCRIPT" "${COMMON_ARGS[@]}" "${CONFIG_ARGS[@]}" >> "$LOG" 2>&1 || RC=$?
echo "# megatron-pp exit code $RC" >> "$LOG"
exit "$RC"
"""  # noqa: E501  (the script's own lines)
)


def default_driver(plan: Mapping[str, Any]) -> str:
    """The training script of a plan's model: ``pretrain_hybrid.py`` for a hybrid model (its rows carry
    ``--hybrid-layer-pattern``), else ``pretrain_gpt.py``."""
    return "pretrain_hybrid.py" if plan["model"].get("hybrid_pattern") else "pretrain_gpt.py"


def check_tokens(tokens: Iterable[str], what: str) -> None:
    """Refuse an argument the script cannot pass unquoted (it is split on blanks at run time)."""
    for tok in tokens:
        if not _SAFE_TOKEN.match(tok):
            raise ValueError(f"{what}: argument {tok!r} has characters the job script cannot pass safely")


def _bash_array(name: str, tokens: Sequence[str]) -> str:
    lines = [f"{name}=("]
    line = "   "
    for tok in tokens:
        piece = " " + shlex.quote(tok)
        if len(line) + len(piece) > 100:
            lines.append(line)
            line = "   "
        line += piece
    lines.append(line)
    lines.append(")")
    return "\n".join(lines)


def _under_submit_dir(path: str) -> str:
    """Text for inside double quotes: ``path`` below ``$SUBMIT_DIR`` unless absolute."""
    check_tokens([path], "path")
    return path if path.startswith("/") else "$SUBMIT_DIR/" + path


def _lines(lines: Iterable[str]) -> str:
    """Whole lines for a line field of the template: each ends in a newline; none is the empty text."""
    return "".join(f"{line}\n" for line in lines)


def sbatch_text(
    plan: Mapping[str, Any],
    rows: Sequence[Mapping[str, Any]],
    opts: GridOptions,
    out: str,
    log_dir: str,
    nodes: int,
    nproc: int,
    common: Sequence[str],
) -> str:
    """The job script for ``rows`` of ``plan`` (``out``, ``log_dir``: as the script names them, relative to
    the submission directory or absolute; ``common``: the flags every configuration shares)."""
    model = plan["model"]["name"]
    q = shlex.quote
    cpus = opts.cpus_per_task or 8 * nproc
    options = (("partition", opts.partition), ("account", opts.account), ("qos", opts.qos))
    script = _under_submit_dir(opts.script) if opts.script else f"$MPP_REPO/scripts/{default_driver(plan)}"
    check_tokens([t for t in (opts.container, opts.container_mounts) if t], "container")
    grid_dir, log_dir_path = _under_submit_dir(out), _under_submit_dir(log_dir)
    setup = [f"source {q(str(Path(opts.venv) / 'bin' / 'activate'))}"] if opts.venv else []
    exports = []
    for key, value in {**DEFAULT_ENV, **opts.env}.items():
        if not _ENV_NAME.match(key):
            raise ValueError(f"bad environment variable name {key!r}")
        exports.append(f"export {key}=${{{key}:-{q(value)}}}" if key in DEFAULT_ENV else f"export {key}={q(value)}")
    return TEMPLATE.substitute(
        count=len(rows),
        model=model,
        gpus=plan["gpus"],
        nodes=nodes,
        nproc=nproc,
        about=_lines(f"# {line}".rstrip() for line in opts.about),
        out=out,
        log_dir=log_dir,
        job_name=opts.job_name or "mpp-" + re.sub(r"[^A-Za-z0-9_.-]", "_", str(model)),
        cpus=cpus,
        time=opts.time,
        array=f"0-{len(rows) - 1}" + (f"%{opts.max_parallel}" if opts.max_parallel else ""),
        sbatch_options=_lines(f"#SBATCH --{key}={value}" for key, value in options if value),
        grid_dir=grid_dir,
        log_dir_path=log_dir_path,
        script=script,
        setup=_lines([*setup, *opts.setup]),
        exports=_lines(exports),
        common_args=_bash_array("COMMON_ARGS", common),
        container=opts.container or "",
        container_mounts=opts.container_mounts or "",
    )
