"""Checked-in plan specifications: the papers' grid searches as ready-to-submit Slurm scripts.

A specification (``scripts/slurm/specs/NAME.json``) names what it reproduces, the planner flags
of the paper's setting (model preset, GPUs, search space), one or more global batch sizes (one
plan each; the array runs the union of their selected rows), the selection (``best_per_schedule``,
``top``) and the cluster side (time, iterations, GPUs per node). ``megatron-pp grid --slurm
--spec FILE`` plans it and writes ``job.sbatch``, ``configs.tsv`` and ``plan.json`` into the
specification's ``out`` directory (relative to the checkout, which is also the submission
directory), so ``tests/planner/test_slurm_specs.py`` can regenerate every script and fail when a
checked-in one differs. ``published`` holds the paper's figures for ``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .grid import write_grid
from .memo import PlannerMemo
from .options import add_plan_arguments, planner_from_args
from .plan_report import plan_document, select_rows
from .sbatch import GridOptions

__all__ = ["SPEC_DIR", "PlanSpec", "load_spec", "plan_spec", "planner_args", "spec_files", "write_spec_grid"]

SPEC_DIR = Path(__file__).resolve().parents[2] / "scripts" / "slurm" / "specs"
_KEYS = {"name", "out", "log_dir", "reproduces", "plan", "global_batch", "select", "slurm", "published"}


@dataclass(frozen=True)
class PlanSpec:
    name: str
    out: str  # relative to the checkout (= submission directory)
    log_dir: str
    reproduces: tuple[str, ...]
    plan_flags: tuple[str, ...]  # `megatron-pp plan` flags of the paper's setting (no --global-batch)
    global_batches: tuple[int, ...]
    best_per_schedule: bool = True
    top: int = 0
    pipeline_only: bool = True  # leave out configurations without a pipeline (pp=1): nothing to schedule
    slurm: Mapping[str, Any] = field(default_factory=dict)
    published: Mapping[str, Any] = field(default_factory=dict)


def _flags(plan: Mapping[str, Any], where: str) -> tuple[str, ...]:
    argv: list[str] = []
    for key, value in plan.items():
        flag = "--" + key.lstrip("-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, list):
            argv += [flag, ",".join(str(v) for v in value)]
        elif isinstance(value, (str, int, float)) and not isinstance(value, bool):
            argv += [flag, str(value)]
        else:
            raise ValueError(
                f"{where}: plan flag {key!r} has value {value!r} (expected text, a number, a list or true)"
            )
    if "--global-batch" in argv:
        raise ValueError(f"{where}: give the global batch as the top-level 'global_batch' list, not a plan flag")
    return tuple(argv)


def load_spec(path: str | Path) -> PlanSpec:
    where = str(path)
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read plan specification {where}: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: a plan specification is a JSON object")
    unknown = sorted(set(raw) - _KEYS)
    missing = sorted({"name", "out", "plan", "global_batch"} - set(raw))
    if unknown or missing:
        raise ValueError(f"{where}: unknown keys {unknown}, missing keys {missing} (keys: {', '.join(sorted(_KEYS))})")
    batches = raw["global_batch"] if isinstance(raw["global_batch"], list) else [raw["global_batch"]]
    if not batches or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in batches):
        raise ValueError(f"{where}: global_batch must be a positive integer or a list of them")
    select = raw.get("select", {})
    reproduces = raw.get("reproduces", [])
    return PlanSpec(
        name=str(raw["name"]),
        out=str(raw["out"]),
        log_dir=str(raw.get("log_dir", f"logs/{raw['name']}")),
        reproduces=tuple([reproduces] if isinstance(reproduces, str) else reproduces),
        plan_flags=_flags(raw["plan"], where),
        global_batches=tuple(batches),
        best_per_schedule=bool(select.get("best_per_schedule", True)),
        top=int(select.get("top", 0)),
        pipeline_only=bool(select.get("pipeline_only", True)),
        slurm=dict(raw.get("slurm", {})),
        published=dict(raw.get("published", {})),
    )


def spec_files(directory: str | Path = SPEC_DIR) -> list[Path]:
    return sorted(Path(directory).glob("*.json"))


def planner_args(spec: PlanSpec, global_batch: int, cache_dir: str | Path | None = None) -> argparse.Namespace:
    """The planner flags of ``spec`` at one global batch, parsed as ``megatron-pp plan`` parses them."""
    parser = argparse.ArgumentParser(prog=f"spec {spec.name}", add_help=False)
    add_plan_arguments(parser)
    cache = ["--cache", str(cache_dir)] if cache_dir is not None else ["--no-cache"]
    try:
        return parser.parse_args([*spec.plan_flags, "--global-batch", str(global_batch), *cache])
    except SystemExit:
        raise ValueError(f"plan specification {spec.name}: bad plan flags {' '.join(spec.plan_flags)}") from None


def plan_spec(
    spec: PlanSpec, memo: PlannerMemo | None = None, cache_dir: str | Path | None = None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Plan every global batch of ``spec``; the plan document (of the first batch, with the
    union of rows) and the selected rows, in order (batch, then rank). The batches' planners share
    ``memo`` (a new one if None): a schedule is built and validated once. ``cache_dir``: the planner's
    disk cache of slow generators' schedules (keyed by the schedules package's source; None: none)."""
    memo = memo if memo is not None else PlannerMemo()
    doc: dict[str, Any] | None = None
    rows: list[dict[str, Any]] = []
    for batch in spec.global_batches:
        planner = planner_from_args(planner_args(spec, batch, cache_dir), memo)
        result = planner.run(progress=False)
        if spec.pipeline_only:
            result.rows = [row for row in result.rows if row.config.pp > 1]
        selected = select_rows(result, spec.best_per_schedule, spec.top or None)
        part = plan_document(result, planner, selected)
        for row in part["rows"]:
            row["global_batch"] = batch
        if doc is None:
            doc = part
            doc["global_batches"] = list(spec.global_batches)  # each row has its own "global_batch"
            doc["spec"] = spec.name
        rows += part["rows"]
    assert doc is not None
    ids = [str(r["id"]) for r in rows]
    if len(ids) != len(set(ids)):
        raise ValueError(f"plan specification {spec.name}: two selected rows share a configuration id")
    doc["rows"] = rows
    return doc, rows


def grid_options(spec: PlanSpec, base_dir: str | Path) -> GridOptions:
    """The cluster side of ``spec``'s grid; its paths relative to ``base_dir`` (the submission directory)."""
    s = spec.slurm
    about = [*spec.reproduces, f"Generated by: megatron-pp grid --slurm --spec scripts/slurm/specs/{spec.name}.json"]
    return GridOptions(
        gpus_per_node=int(s.get("gpus_per_node", 8)),
        time=str(s.get("time", "00:30:00")),
        cpus_per_task=s.get("cpus_per_task"),
        train_iters=int(s.get("train_iters", 20)),
        max_parallel=s.get("max_parallel"),
        log_dir=str(Path(base_dir) / spec.log_dir),
        job_name=f"mpp-{spec.name}",
        base_dir=str(base_dir),
        about=about,
    )


def write_spec_grid(
    spec: PlanSpec,
    base_dir: str | Path,
    out_dir: str | Path | None = None,
    memo: PlannerMemo | None = None,
    cache_dir: str | Path | None = None,
) -> dict[str, Path]:
    """Plan ``spec`` and write its grid into ``out_dir`` (default ``base_dir / spec.out``); ``memo`` and
    ``cache_dir``: see :func:`plan_spec` (one memo for several specs shares their schedules too)."""
    doc, rows = plan_spec(spec, memo, cache_dir)
    out = Path(out_dir) if out_dir is not None else Path(base_dir) / spec.out
    return write_grid(out, doc, rows, grid_options(spec, base_dir))


def published_rows(spec: PlanSpec) -> Sequence[Mapping[str, Any]]:
    return list(spec.published.get("rows", []))
