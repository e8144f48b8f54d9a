"""Rank side of the host-cost guard: Python-level calls per op of our executor, read from a real 2-rank run.

One warm-up iteration, then one iteration under ``sys.setprofile`` counting (a) the Python-level calls
made from the executor's own modules (the executor, its tracer, data and weight-gradient plumbing), into any
module (how often the p2p channels poll inside such a call depends on timing: only the call is counted) and
(b) C-level calls made from the executor's frames (tensor allocations, detaches, string formatting, dict and list work).
Both are fixed by the schedule, not by timing, so a test can bound them exactly.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from megatron_pp_ext.verification.rank_setup import rank_process_group

RUNTIME = Path(__file__).resolve().parents[2] / "megatron_pp_ext" / "runtime"
COUNTED = tuple(str(RUNTIME / name) for name in ("executor.py", "trace.py", "data.py", "wgrad.py"))
EXECUTOR = str(RUNTIME / "executor.py")


def count_calls(payload: tuple[str, int, int], rank: int, init_method: str) -> dict[str, Any]:
    name, p, m = payload
    with rank_process_group(rank, p, init_method, timeout_s=300.0, pp=p):
        from megatron_pp_ext.runtime.executor import make_forward_backward_func
        from megatron_pp_ext.runtime.wgrad_hooks import install_wgrad_hooks, uninstall_wgrad_hooks
        from megatron_pp_ext.schedules import generate
        from megatron_pp_ext.verification import tiny_gpt

        spec = tiny_gpt.TinyGPTSpec(num_layers=2)
        schedule = generate(name, p, m)
        split = any(op.kind.value == "W" for ops in schedule.ops for op in ops)
        if split:
            install_wgrad_hooks()  # before the model is built
        chunks, _ = tiny_gpt.build_chunks(tiny_gpt.make_config(spec), spec, schedule.placement, rank)
        func = make_forward_backward_func(lambda _: schedule, timeout_s=300.0)

        def one(iteration: int) -> None:
            for c in chunks:
                c.zero_grad(set_to_none=True)
            batches = tiny_gpt.make_batches(spec, iteration, m)
            tiny_gpt.run_forward_backward(func, spec, chunks, batches, chunk_list=True)

        one(0)
        calls: dict[str, int] = {}
        c_calls = 0

        def profile(frame: Any, event: str, arg: Any) -> None:
            nonlocal c_calls
            filename = frame.f_code.co_filename
            caller = frame.f_back
            if event == "call" and caller is not None and caller.f_code.co_filename in COUNTED:
                key = f"{Path(caller.f_code.co_filename).name}:{caller.f_code.co_name}->{frame.f_code.co_name}"
                calls[key] = calls.get(key, 0) + 1
            elif event == "c_call" and filename == EXECUTOR:
                c_calls += 1

        sys.setprofile(profile)
        try:
            one(1)
        finally:
            sys.setprofile(None)
            if split:
                uninstall_wgrad_hooks()
        ops = len(schedule.ops[rank])
        return {"rank": rank, "ops": ops, "calls": calls, "c_calls": c_calls}
