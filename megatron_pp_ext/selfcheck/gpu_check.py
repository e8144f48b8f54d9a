"""The GPU check (``scripts/gpu_check.sh``): one run on one GPU, one line per check, a JSON summary.

Checks, in the order they run (docs/gpu.md says what each one shows and what is known not to run):

* ``split-local``, ``split-te``: the B/W split of megatron's local-spec layers and of Transformer Engine's
  layers on the GPU (:mod:`.gpu_split_check`);
* ``pipeline``: two pipeline ranks sharing the GPU over gloo, p2p staged through host memory
  (:mod:`..verification.host_staging`), running ``zb-h1`` and ``v-zb`` with the split; losses and every gradient against
  megatron's own 1F1B on the same two ranks (:func:`pipeline`);
* ``costs``, ``memory``: one layer's F, B, W, BW and W-store bytes against the planner, and a split stage's
  peak memory against the memory model (:mod:`.gpu_costs_check`);
* ``moe-overlap``: one overlapped pair of megatron's combined forward-backward step on CUDA streams, the
  stream of each schedule-plan node recorded (:mod:`.gpu_moe_overlap_check`).

Every check runs in a subprocess of its own (its own process group, killed with its rank processes at its
time limit), so one failing or hanging check does not stop the others; the whole run keeps within
``--budget`` seconds. ``--dry-run`` runs the same code on CPU with tiny shapes (the CI test,
``tests/selfcheck/test_gpu_check.py``), ``--in-process`` runs the checks in this process, time-boxed by ``SIGALRM``
(only for the dry run: a CUDA call cannot be interrupted that way).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from ..argtypes import positive_float

PREFIX = "gpu-check"
# name -> (module, function, time limit in seconds on the GPU)
CHECKS: dict[str, tuple[str, str, float]] = {
    "split-local": ("gpu_split_check", "split_local", 120.0),
    "pipeline": ("gpu_check", "pipeline", 150.0),
    "costs": ("gpu_costs_check", "costs", 120.0),
    "memory": ("gpu_costs_check", "memory", 90.0),
    "split-te": ("gpu_split_check", "split_te", 90.0),
    "moe-overlap": ("gpu_moe_overlap_check", "moe_overlap", 90.0),
}
DEFAULT_BUDGET_S = 450.0  # 8 minutes of checks, less the wheel installation and the interpreter starts
SUMMARY_FILE = "gpu_check.json"
LOG_FILE = "gpu_check.log"
STATUSES = ("pass", "fail", "skip", "error", "timeout")


# ---- the pipeline check -------------------------------------------------------------------------------
def pipeline(device: str, dry_run: bool, pool: Any = None) -> dict[str, Any]:
    """zb-h1 and v-zb on 2 ranks sharing the device, verified as ``megatron-pp verify`` does (against
    megatron's own schedule in float64 and fp32, docs/verification.md).

    ``pool``: a :class:`TrainingRankPool` of at least 2 ranks to run on (tests share theirs); default: a new one."""
    from ..schedules import registry
    from ..verification.rank_run import TrainingRankPool
    from ..verification.run_spec import RunHooks
    from ..verification.tiny_gpt import TinyGPTSpec
    from ..verification.verify import verify_schedule

    p, m = 2, 4
    names = ("zb-h1",) if dry_run else ("zb-h1", "v-zb")
    details: dict[str, Any] = {"p": p, "m": m, "transport": "gloo, CUDA tensors staged through host memory"}
    problems = []
    with contextlib.nullcontext(pool) if pool is not None else TrainingRankPool(p) as pool:
        for name in names:
            schedule = registry.generate(name, p, m)
            # verify's derived verdict: as close to a float64 run of megatron's schedule as megatron's fp32 run
            report = verify_schedule(
                schedule,
                pool,
                model=TinyGPTSpec(num_layers=4),
                iterations=1 if dry_run else 3,
                timeout_s=60.0,
                device=device,
                hooks=RunHooks(stage_p2p_through_host=True),  # on CPU too: the dry run runs the staging code
            )
            details[name] = {
                "ok": report.ok,
                "verdict": report.describe(),
                "max_rel_grad_diff": report.max_rel_grad_diff,
                "max_abs_loss_diff": report.max_abs_loss_diff,
                "losses": report.losses,
                "problems": report.problems,
            }
            if not report.ok:
                problems.append(
                    f"{name}: {report.describe()}" + (f", {report.problems[:2]}" if report.problems else "")
                )
    if problems:
        return {"status": "fail", "summary": "; ".join(problems), "details": details}
    parts = [f"{n} loss diff {details[n]['max_abs_loss_diff']:.1e}" for n in names]
    return {
        "status": "pass",
        "summary": f"p={p} m={m} on one device (gloo, host staging) vs megatron 1F1B: " + ", ".join(parts),
        "details": details,
    }


# ---- running one check ----------------------------------------------------------------------------------
def run_check(name: str, dry_run: bool) -> dict[str, Any]:
    """Call check ``name`` in this process; its result, with ``status`` one of :data:`STATUSES`."""
    module, function, _ = CHECKS[name]
    fn = getattr(importlib.import_module(f"{__package__}.{module}"), function)
    result = fn("cpu" if dry_run else "cuda", dry_run)
    if result.get("status") not in STATUSES:
        raise ValueError(f"check {name} returned status {result.get('status')!r}")
    return result


def _failure(status: str, text: str, details: Any = None) -> dict[str, Any]:
    return {"status": status, "summary": text, "details": details or {}}


def _in_subprocess(name: str, dry_run: bool, limit_s: float, log: Any) -> dict[str, Any]:
    """Run check ``name`` in a child process group, killed (with its rank processes) after ``limit_s``."""
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", f"{__package__}.gpu_check", "--run-one", name, "--result", str(result_path)]
        cmd += ["--dry-run"] if dry_run else []
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return _failure("timeout", f"did not finish within {limit_s:g}s (killed)")
        if result_path.exists():
            return json.loads(result_path.read_text())
        return _failure("error", f"exited with code {code} without a result (see {LOG_FILE})")


@contextlib.contextmanager
def _alarm(limit_s: float) -> Iterator[None]:
    def expired(signum: int, frame: Any) -> None:
        raise TimeoutError(f"did not finish within {limit_s:g}s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, limit_s)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _guarded(name: str, dry_run: bool, limit_s: float) -> dict[str, Any]:
    """In this process: any exception becomes an ``error`` result, the time limit a ``timeout``."""
    try:
        with _alarm(limit_s):
            return run_check(name, dry_run)
    except TimeoutError as exc:
        return _failure("timeout", str(exc))
    except Exception as exc:
        return _failure("error", f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc) else ''}")


# ---- the summary ------------------------------------------------------------------------------------------
def format_line(name: str, result: dict[str, Any]) -> str:
    return f"{PREFIX} {name:<12} {result['status'].upper():<8} {result.get('seconds', 0.0):6.1f}s  {result['summary']}"


def environment(dry_run: bool) -> dict[str, Any]:
    """What ran the check: device, torch / CUDA / megatron-core / Transformer Engine versions."""
    import torch

    info: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "dry_run": dry_run,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": "cpu (dry run)" if dry_run else (torch.cuda.get_device_name() if torch.cuda.is_available() else None),
    }
    for package in ("megatron-core", "transformer-engine", "transformer-engine-torch"):
        try:
            from importlib.metadata import version

            info[package] = version(package)
        except Exception:
            info[package] = None
    return info


def summarize(env: dict[str, Any], results: dict[str, dict[str, Any]], budget_s: float) -> dict[str, Any]:
    ok = all(r["status"] in ("pass", "skip") for r in results.values())
    return {**env, "budget_s": budget_s, "ok": ok, "checks": [{"name": n, **r} for n, r in results.items()]}


# ---- command line ---------------------------------------------------------------------------------------
def check_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in CHECKS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {', '.join(CHECKS)}, got {text!r}")
    return names


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="scripts/gpu_check.sh", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", default=None, help="folder for gpu_check.json and gpu_check.log (default: $OUT, else out/gpu_check)"
    )
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: the script's logic without a GPU (CI)")
    ap.add_argument("--checks", type=check_list, default=list(CHECKS), help=f"subset, in run order: {','.join(CHECKS)}")
    ap.add_argument("--budget", type=positive_float, default=DEFAULT_BUDGET_S, help="seconds for all checks together")
    ap.add_argument(
        "--check-timeout", type=positive_float, default=None, help="seconds per check (default: each one's own)"
    )
    ap.add_argument(
        "--in-process", action="store_true", help="no subprocess per check (dry run only; SIGALRM time box)"
    )
    ap.add_argument("--run-one", choices=list(CHECKS), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.run_one:  # a child: one check, its result as JSON
        result = _guarded(args.run_one, args.dry_run, 24 * 3600.0)
        Path(args.result).write_text(json.dumps(result, default=float))
        return 0
    if args.in_process and not args.dry_run:
        ap.error("--in-process needs --dry-run (a CUDA call cannot be time-boxed inside the process)")
    if not args.dry_run:
        import torch

        if not torch.cuda.is_available():
            ap.error("no CUDA device visible: run on a GPU machine, or add --dry-run for the CPU run")
    out = Path(args.out or os.environ.get("OUT") or "out/gpu_check")
    out.mkdir(parents=True, exist_ok=True)
    env = environment(args.dry_run)
    print(
        f"{PREFIX} device {env['device']}, torch {env['torch']}, CUDA {env['cuda']}, megatron-core "
        f"{env['megatron-core']}, TE {env['transformer-engine']}",
        flush=True,
    )
    results: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + args.budget
    with open(out / LOG_FILE, "a") as log:
        for name in args.checks:
            remaining = deadline - time.monotonic()
            limit = min(args.check_timeout or CHECKS[name][2], remaining)
            if remaining <= 1.0:  # too little left to start an interpreter
                results[name] = {
                    **_failure("timeout", f"not started: the {args.budget:g}s budget was spent"),
                    "seconds": 0.0,
                }
                print(format_line(name, results[name]), flush=True)
                continue
            log.write(f"==== {name}\n")
            log.flush()
            started = time.monotonic()
            if args.in_process:
                result = _guarded(name, args.dry_run, limit)
            else:
                result = _in_subprocess(name, args.dry_run, limit, log)
            result["seconds"] = round(time.monotonic() - started, 2)
            results[name] = result
            print(format_line(name, result), flush=True)
            summary = summarize(env, results, args.budget)
            (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=1, default=float))  # after every check
    summary = summarize(env, results, args.budget)
    (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=1, default=float))
    print(f"{PREFIX} {'OK' if summary['ok'] else 'FAILED'}: {out / SUMMARY_FILE}", flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
