"""What was cut from the executor's host work per op stays cut: the Python-level calls made from our runtime's
modules and the C-level calls made from the executor's frames, counted on a real 2-rank run (not timed).

The counts depend on the schedule only (tests/runtime/call_count_helpers.py says what is counted), so the bound is
exact: a change that adds host work per op to the executor fails here; one that cuts some lowers the ceiling
(update it with the counts this test prints).
"""

from __future__ import annotations

import pytest

from megatron_pp_ext.verification.rank_pool import check_errors
from tests.runtime.call_count_helpers import count_calls

pytestmark = pytest.mark.gloo

# (schedule, p, m) -> per pipeline rank: (Python calls made from the runtime's modules, C calls from executor.py)
CEILINGS = {("1f1b", 2, 4): {0: (289, 67), 1: (293, 69)}, ("zb-h1", 2, 4): {0: (377, 76), 1: (377, 75)}}


@pytest.mark.parametrize("case", sorted(CEILINGS))
def test_host_calls_per_iteration_stay_within_the_cut(pool, case) -> None:
    results = pool.run_fn(count_calls, case, case[1], wall_timeout_s=600)
    check_errors(results)
    for r in results:
        calls, c_calls = sum(r["calls"].values()), r["c_calls"]
        print(f"{case} rank {r['rank']}: {calls} Python calls, {c_calls} C calls over {r['ops']} ops")
        ceiling = CEILINGS[case][r["rank"]]
        assert (calls, c_calls) <= ceiling and calls <= ceiling[0] and c_calls <= ceiling[1], (
            f"rank {r['rank']} made {calls} Python / {c_calls} C calls per iteration, ceiling {ceiling}: "
            f"{sorted(r['calls'].items(), key=lambda kv: -kv[1])[:12]}"
        )
