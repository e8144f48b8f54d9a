"""megatron's grouped-GEMM experts (``TEGroupedMLP`` over TE's ``GroupedLinear``) under the B/W split, on CPU.

Real TE needs CUDA, so megatron's TE wrappers run over the stand-in (tests/runtime/te_megatron_standin.py,
te_standin.py); tests/gpu/test_te_pipeline_gpu.py runs the same with real TE where a GPU is present. Two
gloo ranks (PP = 2, EP = 1), one pool per module. zb-h1's last rank runs its first W last: each W pops
the oldest entry of TE's per-layer FIFO, and the gradients stay bitwise megatron's.
"""

from __future__ import annotations

from .te_grouped_check import GroupedCase, check_results, te_grouped_check

CASE = GroupedCase()


def test_grouped_experts_split_schedules_equal_megatron_1f1b_and_defer_to_w(pool):
    check_results(CASE, pool.run_fn(te_grouped_check, CASE, CASE.world, 300))
