"""The same verdict on any CPU: verification under other kernels and thread counts.

fp32 rounding depends on the instruction set torch's kernels use (``ATEN_CPU_CAPABILITY``: default,
avx2, avx512 where the CPU has it) and on the number of threads; a verdict tuned on one machine
failed correct runs on another. Each case here starts a fresh pool whose ranks run under the
given capability and thread count (checked: every rank reports what it ran with), and verifies the
order megatron itself runs (1f1b with DP=2, megatron DDP) or a split schedule with megatron's
distributed optimizer, by the derived criterion (``verification/criterion.py``). The rest of the
suite runs on this machine's native capability with one thread.
"""

from __future__ import annotations

import os

import pytest
import torch

from megatron_pp_ext.schedules import generate
from megatron_pp_ext.verification.rank_run import TrainingRankPool
from megatron_pp_ext.verification.verify import verify_schedule

NATIVE = torch.backends.cpu.get_cpu_capability().lower()
# (capability, threads): kernels other than this machine's, and two threads
# (capability, threads, schedule, distributed optimizer): kernels other than the suite's (this machine's
# native capability, one thread), and two threads
CASES = [("default", 2, "1f1b", False), ("avx2" if NATIVE != "avx2" else "default", 1, "zb-h1", True)]


@pytest.mark.gloo
@pytest.mark.parametrize(("capability", "threads", "name", "dist_opt"), CASES)
def test_verdict_holds_under_other_kernels_and_thread_counts(monkeypatch, capability, threads, name, dist_opt):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", capability)
    monkeypatch.setenv("OMP_NUM_THREADS", str(threads))
    monkeypatch.setenv("MEGATRON_PP_CPU_THREADS", str(threads))  # the CPU mode's own setting (integration/cpu.py)
    with TrainingRankPool(4) as pool:
        report = verify_schedule(generate(name, 2, 4), pool, dp=2, distributed_optimizer=dist_opt, iterations=2)
        assert report.ok, report.describe()
        assert report.bitwise_megatron_1f1b is (True if name == "1f1b" else None), report.describe()
        print(f"{capability} x {threads} threads, {name}: {report.describe()}")
        ran = pool.run_fn(_capability, None, 4, 120)
    assert {c for c, _ in ran} == {capability.upper()}, ran
    assert {t for _, t in ran} == {threads}, ran
    assert os.environ["ATEN_CPU_CAPABILITY"] == capability


def _capability(_payload, rank: int, init_method: str) -> tuple[str, int]:
    return torch.backends.cpu.get_cpu_capability(), torch.get_num_threads()
