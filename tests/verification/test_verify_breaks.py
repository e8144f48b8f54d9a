"""The verdict is sharp: each deliberate fault of ``verification/breaks.py`` fails verification.

Each case runs a correct schedule with one silent fault injected into its ranks and checks that the
derived criterion (``verification/criterion.py``) rejects it, by a wide margin: the run's worst
tensor must sit at least 100x beyond the allowance (fp32 rounding is ~1e-7, these faults ~1e-3 and
more). The margin is printed (``pytest -s``) so the distance of each break from the bound is on record.
"""

from __future__ import annotations

import pytest

from megatron_pp_ext.schedules import generate
from megatron_pp_ext.verification import criterion
from megatron_pp_ext.verification.breaks import BREAKS
from megatron_pp_ext.verification.run_spec import RunHooks
from megatron_pp_ext.verification.tiny_gpt import TinyGPTSpec
from megatron_pp_ext.verification.verify import verify_schedule

# break -> (schedule, p, m, dp, options of verify_schedule)
CASES = {
    "w-skipped": ("zb-h1", 2, 4, 1, {}),
    "w-twice": ("zb-h1", 2, 4, 1, {}),
    "microbatch-swapped": ("1f1b", 2, 4, 1, {}),
    "dp-reduction-missing": ("1f1b", 2, 2, 2, {}),
    "dp-reduction-early": ("1f1b", 2, 4, 2, {}),
    "fsdp-stale-shards": ("1f1b", 2, 2, 2, {"fsdp": True, "model": TinyGPTSpec(num_layers=2, tied_embeddings=False)}),
    "moe-aux-loss-twice": ("zb-h1", 2, 4, 1, {"model": TinyGPTSpec(num_layers=2, num_experts=4)}),
}


def test_every_break_has_a_case():
    assert sorted(CASES) == sorted(BREAKS)


@pytest.mark.parametrize("fault", sorted(CASES))
def test_break_is_caught_far_outside_the_bound(pool, fault):
    name, p, m, dp, options = CASES[fault]
    iterations = 2 if fault == "fsdp-stale-shards" else 1  # stale weights show from the second iteration on
    report = verify_schedule(
        generate(name, p, m), pool, dp=dp, iterations=iterations, hooks=RunHooks(breaks=(fault,)), **options
    )
    print(f"{fault}: {report.describe()}")
    assert not report.ok
    assert report.worst_ratio is not None and report.worst_ratio >= 100 * criterion.GROWTH, report.describe()
    if name == "1f1b" and not options.get("fsdp"):  # megatron's own order: demanded bit for bit too
        assert report.bitwise_megatron_1f1b is False


def test_break_is_caught_by_a_fixed_tolerance_too(pool):
    """``--tolerance`` keeps its meaning (a bound on the max relative gradient difference)."""
    fault = "dp-reduction-missing"
    name, p, m, dp, options = CASES[fault]
    report = verify_schedule(
        generate(name, p, m), pool, dp=dp, iterations=1, hooks=RunHooks(breaks=(fault,)), tol=1e-3, **options
    )
    assert not report.ok and report.max_rel_grad_diff > 1e-3
