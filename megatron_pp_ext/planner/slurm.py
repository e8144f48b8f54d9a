"""``megatron-pp grid --slurm``: a Slurm job array running the planned configurations.

Writes into ``--out DIR``:

* ``configs.tsv`` -- one line per configuration: array task id, config id, the
  ``scripts/pretrain_gpt.py`` flags of that configuration (parallelism, schedule, micro-batch,
  recompute, ...), then the planner's predictions (for ``collect``);
* ``plan.json`` -- the plan the configurations came from (model, setup, predictions);
* ``job.sbatch`` -- the array job: task ``i`` reads line ``i`` of ``configs.tsv`` and runs
  ``srun torchrun ... scripts/pretrain_gpt.py COMMON_ARGS CONFIG_ARGS`` on all nodes of the
  allocation (c10d rendezvous on the first node), for a fixed number of iterations with
  Megatron's throughput, timer and memory logs on, writing ``LOGDIR/<config id>.log`` (first line:
  the config id; last line: the exit code), which ``megatron-pp collect LOGDIR`` reads.

Submit with ``sbatch DIR/job.sbatch``. :func:`driver_flags` and :func:`unknown_flags` check every
flag the script passes against what ``scripts/pretrain_gpt.py`` accepts.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import shlex
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..argtypes import output_dir
from .children import run_child
from .files import MAX_PLAN_BYTES, read_capped

__all__ = [
    "GridOptions",
    "add_parser",
    "common_args",
    "driver_flags",
    "flags_in_grid",
    "unknown_flags",
    "write_grid",
]

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SCRIPT = REPO_ROOT / "scripts" / "pretrain_gpt.py"
CONFIG_COLUMNS = (
    "task",
    "id",
    "args",
    "schedule",
    "tp",
    "pp",
    "dp",
    "micro_batch",
    "num_microbatches",
    "chunks",
    "recompute",
    "predicted_iteration_time_s",
    "predicted_tflops_per_gpu",
    "predicted_peak_memory_gib",
)
_SAFE_TOKEN = re.compile(r"^[A-Za-z0-9_.,@=:/+%-]+$")
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
    script: str | None = None  # default: $MPP_REPO/scripts/pretrain_gpt.py on the cluster
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    job_name: str | None = None
    base_dir: str | None = None  # paths in the script are relative to this (the submission directory); default cwd
    about: list[str] = field(default_factory=list)  # header lines: what the script reproduces


def common_args(plan: Mapping[str, Any], train_iters: int, extra: Sequence[str] = ()) -> list[str]:
    """Flags every configuration shares: model, precision, mock data, a fixed number of
    iterations, logging of throughput, timers (min/max over ranks) and memory."""
    return [
        *plan["model_args"],
        *plan["precision_args"],
        "--mock-data",
        "--train-iters",
        str(train_iters),
        "--eval-iters",
        "0",
        "--eval-interval",
        str(max(1000, 10 * train_iters)),
        "--lr",
        "1.0e-4",
        "--lr-decay-style",
        "constant",
        "--weight-decay",
        "0.1",
        "--clip-grad",
        "1.0",
        "--init-method-std",
        "0.006",
        "--seed",
        "1234",
        "--log-interval",
        "1",
        "--log-throughput",
        "--timing-log-level",
        "2",
        "--timing-log-option",
        "minmax",
        "--log-memory-interval",
        str(max(1, train_iters // 2)),
        "--distributed-timeout-minutes",
        "30",
        *extra,
    ]


def _check_tokens(tokens: Iterable[str], what: str) -> None:
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


def write_grid(
    out_dir: str | Path, plan: Mapping[str, Any], rows: Sequence[Mapping[str, Any]], opts: GridOptions
) -> dict[str, Path]:
    """Write ``configs.tsv``, ``plan.json`` and ``job.sbatch`` for ``rows`` (entries of a plan
    document, each with ``megatron_args``); returns their paths."""
    if not rows:
        raise ValueError("no configuration to write (the plan selected none)")
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    log_dir = Path(opts.log_dir).resolve() if opts.log_dir else out / "logs"
    base = Path(opts.base_dir or Path.cwd()).resolve()
    gpus = int(plan["gpus"])
    gpn = int(opts.gpus_per_node)
    nodes = opts.nodes or max(1, math.ceil(gpus / gpn))
    if gpus % nodes:
        raise ValueError(f"{gpus} GPUs do not split over {nodes} nodes")
    nproc = gpus // nodes
    if nproc > gpn:
        raise ValueError(f"{gpus} GPUs on {nodes} node(s) is {nproc} per node, more than --gpus-per-node {gpn}")
    common = common_args(plan, opts.train_iters, opts.extra_args)
    _check_tokens(common, "common arguments")

    # configs.tsv
    lines = ["\t".join(CONFIG_COLUMNS)]
    for task, row in enumerate(rows):
        args = list(row["megatron_args"])
        _check_tokens(args, f"configuration {row['id']}")
        cells = [
            str(task),
            str(row["id"]),
            " ".join(args),
            str(row["schedule"]),
            str(row["tp"]),
            str(row["pp"]),
            str(row["dp"]),
            str(row["micro_batch"]),
            str(row["num_microbatches"]),
            str(row["chunks"]),
            str(row["recompute"]),
            str(row.get("iteration_time_s", "")),
            str(row.get("tflops_per_gpu", "")),
            str(row.get("peak_memory_gib", "")),
        ]
        if any("\t" in c or "\n" in c for c in cells):
            raise ValueError(f"configuration {row['id']}: a field contains a tab or newline")
        lines.append("\t".join(cells))
    configs = out / "configs.tsv"
    configs.write_text("\n".join(lines) + "\n")

    doc = dict(plan)
    doc["rows"] = list(rows)
    doc["grid"] = {"nodes": nodes, "gpus_per_node": nproc, "train_iters": opts.train_iters, "common_args": common}
    plan_path = out / "plan.json"
    plan_path.write_text(json.dumps(doc, indent=1) + "\n")

    sbatch = out / "job.sbatch"
    sbatch.write_text(_sbatch_text(plan, rows, opts, _rel(out, base), _rel(log_dir, base), nodes, nproc, common))
    sbatch.chmod(0o755)
    return {"configs": configs, "plan": plan_path, "sbatch": sbatch, "log_dir": log_dir}


def _rel(path: Path, base: Path) -> str:
    """``path`` relative to ``base`` (the submission directory) when it lies below it, else as given."""
    try:
        return str(path.relative_to(base))
    except ValueError:
        return str(path)


def _under_submit_dir(path: str) -> str:
    """Text for inside double quotes: ``path`` below ``$SUBMIT_DIR`` unless absolute."""
    _check_tokens([path], "path")
    return path if path.startswith("/") else "$SUBMIT_DIR/" + path


def _sbatch_text(
    plan: Mapping[str, Any],
    rows: Sequence[Mapping[str, Any]],
    opts: GridOptions,
    out: str,
    log_dir: str,
    nodes: int,
    nproc: int,
    common: Sequence[str],
) -> str:
    model = plan["model"]["name"]
    q = shlex.quote
    array = f"0-{len(rows) - 1}" + (f"%{opts.max_parallel}" if opts.max_parallel else "")
    cpus = opts.cpus_per_task or 8 * nproc
    job_name = opts.job_name or "mpp-" + re.sub(r"[^A-Za-z0-9_.-]", "_", str(model))
    head = [
        "#!/bin/bash",
        f"# megatron-pp grid: {len(rows)} configuration(s) of {model} on {plan['gpus']} GPUs "
        f"({nodes} node(s) x {nproc}); one configuration per array task.",
        *[f"# {line}".rstrip() for line in opts.about],
        "#",
        "# Submit from the directory the paths below are relative to (a checkout of megatron_pp_ext):",
        f"#   sbatch {out}/job.sbatch",
        "# Cluster settings: sbatch's own flags override the #SBATCH lines, e.g.",
        f"#   sbatch --partition=PART --account=ACCT --time=01:00:00 {out}/job.sbatch",
        "# Environment (read at run time; sbatch passes your environment on):",
        "#   MPP_REPO            megatron_pp_ext checkout on the cluster (default: the submission directory)",
        "#   MPP_GRID_DIR        directory holding configs.tsv and plan.json (default below)",
        "#   MPP_SCRIPT          training driver (default: $MPP_REPO/scripts/pretrain_gpt.py)",
        "#   MPP_LOG_DIR         where each configuration's log goes (default below)",
        "#   MPP_VENV            virtualenv / conda prefix to activate (PREFIX/bin/activate)",
        "#   MPP_CONTAINER       container image for srun --container-image (pyxis/enroot), MPP_CONTAINER_MOUNTS",
        "#   MPP_SETUP           a shell line run before srun (e.g. 'module load cuda/12.4')",
        f"# Collect: megatron-pp collect {log_dir}",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={nproc}",
        f"#SBATCH --cpus-per-task={cpus}",
        "#SBATCH --exclusive",
        f"#SBATCH --time={opts.time}",
        f"#SBATCH --array={array}",
        "#SBATCH --output=slurm-%x-%A_%a.out",
    ]
    if opts.partition:
        head.append(f"#SBATCH --partition={opts.partition}")
    if opts.account:
        head.append(f"#SBATCH --account={opts.account}")
    if opts.qos:
        head.append(f"#SBATCH --qos={opts.qos}")
    script = _under_submit_dir(opts.script) if opts.script else "$MPP_REPO/scripts/pretrain_gpt.py"
    _check_tokens([t for t in (opts.container, opts.container_mounts) if t], "container")
    body = [
        "set -euo pipefail",
        "",
        'SUBMIT_DIR="${SLURM_SUBMIT_DIR:-$PWD}"',
        'MPP_REPO="${MPP_REPO:-$SUBMIT_DIR}"',
        f'GRID_DIR="${{MPP_GRID_DIR:-{_under_submit_dir(out)}}}"',
        f'LOG_DIR="${{MPP_LOG_DIR:-{_under_submit_dir(log_dir)}}}"',
        f'SCRIPT="${{MPP_SCRIPT:-{script}}}"',
        'CONFIGS="$GRID_DIR/configs.tsv"',
        'if [ ! -f "$CONFIGS" ]; then',
        '  echo "$CONFIGS not found: submit from the directory this script\'s paths are relative to," \\',
        '    "or set MPP_GRID_DIR to the directory holding configs.tsv" >&2',
        "  exit 2",
        "fi",
        f"NPROC_PER_NODE={nproc}",
        'mkdir -p "$LOG_DIR"',
        '[ -e "$LOG_DIR/plan.json" ] || cp "$GRID_DIR/plan.json" "$LOG_DIR/plan.json" 2>/dev/null || true',
        "",
        "# ---- environment ----",
        'if [ -n "${MPP_VENV:-}" ]; then source "$MPP_VENV/bin/activate"; fi',
    ]
    if opts.venv:
        body.append(f"source {q(str(Path(opts.venv) / 'bin' / 'activate'))}")
    body += list(opts.setup)
    body.append('if [ -n "${MPP_SETUP:-}" ]; then eval "$MPP_SETUP"; fi')
    env = dict(DEFAULT_ENV)
    env.update(opts.env)
    for key, value in env.items():
        if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", key):
            raise ValueError(f"bad environment variable name {key!r}")
        body.append(f"export {key}=${{{key}:-{q(value)}}}" if key in DEFAULT_ENV else f"export {key}={q(value)}")
    body.append('export PYTHONPATH="$MPP_REPO${PYTHONPATH:+:$PYTHONPATH}"')
    body += [
        "",
        "# ---- this task's configuration ----",
        'TASK="${SLURM_ARRAY_TASK_ID:?submit with sbatch: this is a job array}"',
        "LINE=$(awk -F'\\t' -v task=\"$TASK\" 'NR > 1 && $1 == task' \"$CONFIGS\")",
        'if [ -z "$LINE" ]; then echo "no configuration $TASK in $CONFIGS" >&2; exit 2; fi',
        "CONFIG_ID=$(printf '%s\\n' \"$LINE\" | cut -f2)",
        "CONFIG_ARGS_TEXT=$(printf '%s\\n' \"$LINE\" | cut -f3)",
        'read -r -a CONFIG_ARGS <<< "$CONFIG_ARGS_TEXT"',
        "",
        "# Shared by every configuration: model, precision, mock data, fixed iterations, logs.",
        _bash_array("COMMON_ARGS", common),
        "",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "MASTER_PORT=$((29500 + TASK % 1000))",
        'LOG="$LOG_DIR/$CONFIG_ID.log"',
        "{",
        '  echo "# megatron-pp config $CONFIG_ID (array task $TASK of job ${SLURM_ARRAY_JOB_ID:-?}, '
        'nodes $SLURM_JOB_NODELIST)"',
        '  echo "# args: ${COMMON_ARGS[*]} ${CONFIG_ARGS[*]}"',
        '} > "$LOG"',
        "",
        "# srun does not inherit --cpus-per-task from sbatch (Slurm >= 22.05): pass it on.",
        f'SRUN_ARGS=(--kill-on-bad-exit=1 --ntasks-per-node=1 --cpus-per-task="${{SLURM_CPUS_PER_TASK:-{cpus}}}")',
        f'CONTAINER="${{MPP_CONTAINER:-{opts.container or ""}}}"',
        f'CONTAINER_MOUNTS="${{MPP_CONTAINER_MOUNTS:-{opts.container_mounts or ""}}}"',
        'if [ -n "$CONTAINER" ]; then',
        '  SRUN_ARGS+=(--container-image="$CONTAINER" --container-workdir="$SUBMIT_DIR")',
        '  if [ -n "$CONTAINER_MOUNTS" ]; then SRUN_ARGS+=(--container-mounts="$CONTAINER_MOUNTS"); fi',
        "fi",
        "",
        "RC=0",
        'srun "${SRUN_ARGS[@]}" \\',
        '  torchrun --nnodes "$SLURM_NNODES" --nproc-per-node "$NPROC_PER_NODE" \\',
        '    --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" '
        '--rdzv-id "${SLURM_ARRAY_JOB_ID:-0}_$TASK" \\',
        '    "$SCRIPT" "${COMMON_ARGS[@]}" "${CONFIG_ARGS[@]}" >> "$LOG" 2>&1 || RC=$?',
        'echo "# megatron-pp exit code $RC" >> "$LOG"',
        'exit "$RC"',
        "",
    ]
    return "\n".join([*head, "", *body])


# ---- static checks ------------------------------------------------------------------------------------
_FLAG = re.compile(r"(?<![A-Za-z0-9_-])(--[A-Za-z0-9][A-Za-z0-9_-]*)")

_PARSER_DUMP = """
import argparse, sys
sys.path.insert(0, {root!r})
from megatron_pp_ext.megatron import cpu
cpu.enable_cpu_mode(force=True)
from megatron.training.arguments import add_megatron_arguments
import megatron_pp_ext
parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
parser = megatron_pp_ext.add_arguments(parser)
for action in parser._actions:
    for option in action.option_strings:
        print(option)
"""


_PIPED = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}


def driver_flags(
    script: str | Path = DEFAULT_SCRIPT, python: str = sys.executable, timeout: float = 600
) -> tuple[set[str], str]:
    """Flags ``script`` accepts, from ``python script --help``; ``(flags, how they were found)``.

    If ``--help`` fails (megatron-core 0.19.2's own parser cannot format its help: a ``%`` in
    the help of ``--moe-paged-stash-buffer-size-factor-cuda``), falls back to building the same
    parser the driver builds (megatron's ``add_megatron_arguments`` plus the plugin's
    ``add_arguments``) in a subprocess and listing its option strings."""
    env_cmd = [python, str(script), "--help"]
    try:
        code, out, err = run_child(env_cmd, timeout=timeout, **_PIPED)
        flags = set(_FLAG.findall(out or ""))
        if code == 0 and "--pipeline-schedule" in flags and "--num-layers" in flags:
            return flags, f"{Path(script).name} --help"
        why = ((err or "").strip().splitlines() or [f"exit code {code}"])[-1]
    except (OSError, subprocess.TimeoutExpired) as exc:
        why = str(exc)
    code, out, err = run_child([python, "-c", _PARSER_DUMP.format(root=str(REPO_ROOT))], timeout=timeout, **_PIPED)
    if code != 0:
        raise RuntimeError(f"cannot list the driver's flags: --help failed ({why}); parser dump failed: {err}")
    flags = {line.strip() for line in (out or "").splitlines() if line.strip().startswith("--")}
    return flags, f"parser introspection (megatron + plugin parsers; --help failed: {why})"


def flags_in_grid(grid_dir: str | Path) -> set[str]:
    """Every ``--flag`` the job script passes to the driver (common and per-configuration)."""
    grid = Path(grid_dir)
    text = (grid / "job.sbatch").read_text()
    start = text.index("COMMON_ARGS=(")
    common = text[start : text.index("\n)", start)]
    flags = set(_FLAG.findall(common))
    for line in (grid / "configs.tsv").read_text().splitlines()[1:]:
        flags |= set(_FLAG.findall(line.split("\t")[2]))
    return flags


def unknown_flags(grid_dir: str | Path, known: set[str]) -> list[str]:
    return sorted(flags_in_grid(grid_dir) - known)


# ---- command line ---------------------------------------------------------------------------------
def add_parser(subparsers: Any) -> None:
    from .plan_cli import add_plan_arguments, add_top_argument

    p = subparsers.add_parser(
        "grid",
        help="write a Slurm job array (sbatch + config table) running planned configurations",
        description="Select configurations from a plan (--plan FILE, or plan now with the plan flags) and "
        "write DIR/job.sbatch, DIR/configs.tsv and DIR/plan.json; submit with `sbatch DIR/job.sbatch`.",
    )
    p.add_argument("--slurm", action="store_true", help="write a Slurm job array (the only backend)")
    p.add_argument("--out", type=output_dir, metavar="DIR", help="directory for job.sbatch, configs.tsv, plan.json")
    p.add_argument("--plan", metavar="PLAN.json", help="a plan written by `megatron-pp plan --save`")
    p.add_argument(
        "--spec",
        metavar="SPEC.json",
        help="a checked-in plan specification (scripts/slurm/specs/*.json): plan it and write its script "
        "into its 'out' directory (relative to the current directory, the submission directory)",
    )
    sel = p.add_argument_group("selection")
    sel.add_argument("--best-per-schedule", action="store_true", help="each schedule's best configuration")
    add_top_argument(sel, 8)
    sl = p.add_argument_group("slurm")
    sl.add_argument("--nodes", type=int, help="nodes per configuration (default: GPUs / GPUs per node)")
    sl.add_argument("--partition")
    sl.add_argument("--account")
    sl.add_argument("--qos")
    sl.add_argument("--time", default="00:30:00", help="time limit per configuration (default 00:30:00)")
    sl.add_argument("--cpus-per-task", type=int)
    sl.add_argument("--container", help="container image (pyxis: srun --container-image)")
    sl.add_argument("--container-mounts", help="srun --container-mounts value")
    sl.add_argument("--venv", help="virtualenv / conda prefix to activate (PREFIX/bin/activate)")
    sl.add_argument("--setup", action="append", default=[], help="shell line run before srun (repeatable)")
    sl.add_argument("--log-dir", help="where each configuration's log goes (default: OUT/logs)")
    sl.add_argument("--train-iters", type=int, default=20, help="iterations per configuration (default 20)")
    sl.add_argument("--max-parallel", type=int, help="at most this many array tasks at once")
    sl.add_argument(
        "--script", help="path of pretrain_gpt.py on the cluster (default: $MPP_REPO/scripts/pretrain_gpt.py)"
    )
    sl.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="extra environment (repeatable)")
    sl.add_argument("--extra-args", default="", help="more pretrain_gpt.py flags for every configuration")
    sl.add_argument("--check", action="store_true", help="check every flag against pretrain_gpt.py (slow, ~20 s)")
    add_plan_arguments(p)
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None)
    p.set_defaults(func=cmd_grid)


def _plan_row(row: object) -> bool:
    """A plan row the launchers can run: an id and a list of flags."""
    return (
        isinstance(row, dict)
        and isinstance(row.get("id"), str)
        and isinstance(row.get("megatron_args"), list)
        and all(isinstance(a, str) for a in row["megatron_args"])
    )


def load_or_plan(args: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The plan document and its selected rows: from ``--plan`` or by planning now."""
    from .plan_cli import planner_from_args
    from .report import plan_document

    if args.plan:
        try:
            doc = json.loads(read_capped(args.plan, MAX_PLAN_BYTES, "plan"))
        except ValueError as exc:
            raise ValueError(f"cannot read plan {args.plan}: {str(exc)[:200]}") from None
        if (
            not isinstance(doc, dict)
            or doc.get("format") != "megatron-pp plan v1"
            or not isinstance(doc.get("rows"), list)
        ):
            got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
            raise ValueError(f"{args.plan} is not a megatron-pp plan (format {got!r}, written by `plan --save`)")
        rows = list(doc["rows"])
        bad = next((i for i, r in enumerate(rows) if not _plan_row(r)), None)
        if bad is not None:
            raise ValueError(f"{args.plan}: row {bad} is not a configuration with an 'id' and 'megatron_args'")
    else:
        planner = planner_from_args(args)
        result = planner.run(progress=getattr(args, "progress", None))
        doc = plan_document(result, planner, result.rows)
        rows = list(doc["rows"])
    if args.best_per_schedule:
        seen: dict[str, dict[str, Any]] = {}
        for row in rows:
            key = str(row["schedule"]) + "@" + str(row.get("memory_limit"))
            seen.setdefault("pp=1" if row.get("pp") == 1 else key, row)  # no pipeline: one group
        rows = list(seen.values())
    if args.top:
        rows = rows[: args.top]
    return doc, rows


def cmd_grid(args: argparse.Namespace) -> int:
    if not args.slurm:
        raise ValueError("give --slurm (the only launcher backend); for this machine use `megatron-pp launch-local`")
    if args.spec:
        from .specs import load_spec, write_spec_grid

        spec = load_spec(args.spec)
        paths = write_spec_grid(spec, Path.cwd(), args.out)
        print(f"wrote {_rel(paths['sbatch'].resolve(), Path.cwd())} (+ configs.tsv, plan.json); submit from here")
        return 0
    if not args.out:
        raise ValueError("give --out DIR (or --spec SPEC.json)")
    env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--env expects KEY=VALUE, got {item!r}")
        env[key] = value
    doc, rows = load_or_plan(args)
    opts = GridOptions(
        nodes=args.nodes,
        gpus_per_node=args.gpus_per_node or int(doc.get("gpus_per_node") or 8),
        partition=args.partition,
        account=args.account,
        qos=args.qos,
        time=args.time,
        cpus_per_task=args.cpus_per_task,
        container=args.container,
        container_mounts=args.container_mounts,
        venv=args.venv,
        setup=list(args.setup),
        log_dir=args.log_dir,
        train_iters=args.train_iters,
        max_parallel=args.max_parallel,
        script=args.script,
        extra_args=shlex.split(args.extra_args),
        env=env,
    )
    paths = write_grid(args.out, doc, rows, opts)
    here = Path.cwd()
    sbatch, logs = (_rel(paths[k].resolve(), here) for k in ("sbatch", "log_dir"))
    print(f"wrote {sbatch} ({len(rows)} array tasks), configs.tsv and plan.json next to it")
    print(f"submit from {here} (the script's paths are relative to it): sbatch {sbatch}")
    print(f"logs go to {logs}; then: megatron-pp collect {logs}")
    if args.check:
        known, how = driver_flags(args.script or DEFAULT_SCRIPT)
        bad = unknown_flags(args.out, known)
        if bad:
            print(f"UNKNOWN flags (not accepted by {args.script}, via {how}): {', '.join(bad)}", file=sys.stderr)
            return 1
        print(f"every flag is accepted by {Path(args.script or DEFAULT_SCRIPT).name} (checked via {how})")
    return 0
