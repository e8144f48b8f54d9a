"""What a MoE verification run accepts: one line per refused request (no torch, so the CLI asks before
any rank starts, and :func:`~.verify.verify_schedule` asks again for callers from Python)."""

from __future__ import annotations


def moe_problem(
    num_experts: int | None, moe_topk: int, ep: int, dp: int, tp: int = 1, fsdp: bool = False
) -> str | None:
    """Why megatron cannot build this expert layout here (a line naming the options), or None."""
    if ep < 1:
        return f"--ep must be >= 1, got {ep}"
    if not num_experts:
        return f"--ep {ep} goes with a MoE model: add --num-experts (a multiple of {ep})" if ep > 1 else None
    if num_experts % ep:
        return f"--num-experts {num_experts} is not a multiple of --ep {ep}"
    if dp % ep:
        return f"--ep {ep} splits the experts over data-parallel ranks: --dp {dp} must be a multiple of it"
    if not 1 <= moe_topk <= num_experts:
        return f"--moe-topk {moe_topk} must be between 1 and --num-experts {num_experts}"
    if tp > 1:
        return f"--num-experts with --tp {tp}: MoE verification runs at --tp 1 only"
    if fsdp:
        return "--fsdp with --num-experts: FSDP does not shard expert parameters yet (drop one of them)"
    return None
