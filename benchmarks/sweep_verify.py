"""The verdict's sweep: every registered schedule x p x m x data parallelism, zero false failures?

Runs ``verify`` (the derived criterion of ``verification/criterion.py``) on every combination of

* every registered schedule (``v-block`` needs a block file: left out) with its defaults,
* p in ``--p`` (default 2 4) and m in 1 .. 2p+1 (combinations a generator refuses are counted, not run),
* dp = 1 (megatron DDP) and dp = 2 with megatron DDP, megatron's distributed optimizer, and FSDP
  where the schedule declares FSDP support (untied embeddings),

under the CPU capability and thread count of the environment (``ATEN_CPU_CAPABILITY``,
``MEGATRON_PP_CPU_THREADS``). Each result is appended as a JSON line to ``--out`` (resumable: lines
already there are skipped), and a summary is printed: runs, failures (each named), the worst ratio
of our error to megatron fp32's (the criterion allows ``criterion.GROWTH``).

    ATEN_CPU_CAPABILITY=avx2 python benchmarks/sweep_verify.py --out sweep-avx2.jsonl [--p 2] [--iterations 2]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from megatron_pp_ext.schedules import registry
from megatron_pp_ext.schedules.ir import ScheduleError
from megatron_pp_ext.verification import criterion
from megatron_pp_ext.verification.rank_pool import VerifyRunError
from megatron_pp_ext.verification.rank_run import TrainingRankPool
from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec
from megatron_pp_ext.verification.verify import verify_schedule

MODES = ("ddp", "distributed-optimizer", "fsdp")


def cases(ps: list[int]) -> list[tuple[str, int, int, int, str]]:
    """Schedules innermost: consecutive cases share their references (verify runs each once per pool)."""
    names = [n for n in registry.names() if n != "v-block"]
    fsdp = {n: registry.get(n).capabilities.data_parallel.fsdp != "no" for n in names}
    out = []
    for p in ps:
        for m in range(1, 2 * p + 2):
            for dp, mode in [(1, "ddp"), *((2, mode) for mode in MODES)]:
                out.extend((name, p, m, dp, mode) for name in names if mode != "fsdp" or fsdp[name])
    return out


def key(case: tuple[str, int, int, int, str]) -> str:
    return "{}/p{}/m{}/dp{}/{}".format(*case)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--p", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, one per case (resumed if present)")
    args = parser.parse_args()
    done = set()
    if args.out.exists():
        done = {json.loads(line)["case"] for line in args.out.read_text().splitlines() if line.strip()}
    todo = [c for c in cases(args.p) if key(c) not in done]
    env = {k: os.environ.get(k, "") for k in ("ATEN_CPU_CAPABILITY", "MEGATRON_PP_CPU_THREADS")}
    print(f"{len(todo)} case(s) to run ({len(done)} already in {args.out}); environment {env}", flush=True)
    pools: dict[int, TrainingRankPool] = {}
    try:
        for case in todo:
            name, p, m, dp, mode = case
            row: dict[str, object] = {"case": key(case), **env}
            started = time.monotonic()
            try:
                schedule = registry.generate(name, p, m)
            except (ScheduleError, ValueError) as exc:
                row.update(status="refused by the generator", reason=str(exc).splitlines()[0][:200])
            else:
                size = p * dp
                if size not in pools:
                    pools[size] = TrainingRankPool(size)
                model = TinyGPTSpec(num_layers=schedule.placement.stages_per_replica, tied_embeddings=mode != "fsdp")
                try:
                    report = verify_schedule(
                        schedule,
                        pools[size],
                        model=model,
                        dp=dp,
                        distributed_optimizer=mode == "distributed-optimizer",
                        fsdp=mode == "fsdp",
                        iterations=args.iterations,
                        trace=False,
                    )
                except (VerifyRunError, TimeoutError, ValueError) as exc:
                    row.update(status="run failed", reason=str(exc).splitlines()[0][:300])
                else:
                    row.update(
                        status="ok" if report.ok else "FAILED",
                        worst_ratio=report.worst_ratio,
                        verdict=report.verdict,
                        problems=report.problems[:3],
                        bitwise=report.bitwise_equal,
                    )
            row["seconds"] = round(time.monotonic() - started, 1)
            with args.out.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(f"{row['case']}: {row['status']} {row.get('worst_ratio', '')}", flush=True)
    finally:
        for pool in pools.values():
            pool.close()
    summarize(args.out)


def summarize(path: Path) -> None:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    by_status: dict[str, int] = {}
    for r in rows:
        by_status[r["status"]] = by_status.get(r["status"], 0) + 1
    ratios = [r["worst_ratio"] for r in rows if r.get("worst_ratio") is not None]
    print(f"{len(rows)} cases: {by_status}")
    if ratios:
        worst = max(rows, key=lambda r: r.get("worst_ratio") or 0)
        print(f"worst ratio {max(ratios):.3g} (allowed {criterion.GROWTH:g}) at {worst['case']}: {worst['verdict']}")
    for r in rows:
        if r["status"] in ("FAILED", "run failed"):
            print(f"  {r['status']}: {r['case']}: {r.get('verdict') or r.get('reason')} {r.get('problems', '')}")


if __name__ == "__main__":
    main()
