"""``megatron-pp grid --slurm``'s files: a Slurm job array running the planned configurations.

Writes into ``--out DIR``:

* ``configs.tsv`` -- one line per configuration: array task id, config id, the
  ``scripts/pretrain_gpt.py`` flags of that configuration (parallelism, schedule, micro-batch,
  recompute, ...), then the planner's predictions (for ``collect``);
* ``plan.json`` -- the plan the configurations came from (model, setup, predictions);
* ``job.sbatch`` -- the array job (:mod:`.sbatch`), for a fixed number of iterations with Megatron's
  throughput, timer and memory logs on (:func:`common_args`).

Submit with ``sbatch DIR/job.sbatch``; :mod:`.driver_flags` checks every flag the script passes against
what ``scripts/pretrain_gpt.py`` accepts.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .sbatch import GridOptions, check_tokens, sbatch_text

__all__ = ["CONFIG_COLUMNS", "DEFAULT_SCRIPT", "REPO_ROOT", "common_args", "relative_path", "write_grid"]

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
    check_tokens(common, "common arguments")

    # configs.tsv
    lines = ["\t".join(CONFIG_COLUMNS)]
    for task, row in enumerate(rows):
        args = list(row["megatron_args"])
        check_tokens(args, f"configuration {row['id']}")
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
    sbatch.write_text(
        sbatch_text(plan, rows, opts, relative_path(out, base), relative_path(log_dir, base), nodes, nproc, common)
    )
    sbatch.chmod(0o755)
    return {"configs": configs, "plan": plan_path, "sbatch": sbatch, "log_dir": log_dir}


def relative_path(path: Path, base: Path) -> str:
    """``path`` relative to ``base`` (the submission directory) when it lies below it, else as given."""
    try:
        return str(path.relative_to(base))
    except ValueError:
        return str(path)
