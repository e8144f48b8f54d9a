"""Comparison of a verification run with its references: the numbers of :class:`~.verify_report.VerifyReport`.

The runs themselves happen in :mod:`.rank_run` (driven by :mod:`.verify`); the verdict's criterion is
:mod:`.criterion`; the report and its text are :mod:`.verify_report`.
"""

from __future__ import annotations

from typing import Any

from . import criterion
from .rank_pool import VerifyRunError
from .verify_report import VerifyReport


def _losses(results: list[dict[str, Any]]) -> list[list[float]]:
    """Per iteration, the micro-batch losses of the whole global batch: data-parallel replica by
    replica (tensor-parallel rank 0), and within one the losses of every rank that computed some
    (a bidirectional schedule computes them on two ranks) in micro-batch order (a schedule may run
    the last stage's forwards out of micro-batch order)."""
    holders = [r for r in results if r["losses"] and r["losses"][0] and r.get("tp_rank", 0) == 0]
    if not holders:
        raise VerifyRunError("no rank reported a loss")
    by_dp: dict[int, list[dict[str, Any]]] = {}
    for r in holders:
        by_dp.setdefault(r.get("dp_rank", 0), []).append(r)
    merged: list[list[float]] = []
    for it in range(len(holders[0]["losses"])):
        row: list[float] = []
        for d in sorted(by_dp):
            ranks = by_dp[d]
            if any(r.get("loss_microbatches") is None for r in ranks):  # megatron's own order: by micro-batch
                row += ranks[0]["losses"][it]
                continue
            by_mb: dict[int, float] = {}
            for r in ranks:
                by_mb.update(zip(r["loss_microbatches"], r["losses"][it], strict=True))
            row += [by_mb[mb] for mb in sorted(by_mb)]
        merged.append(row)
    return merged


def _replica_copies_differ(results: list[dict[str, Any]]) -> list[str]:
    """Bidirectional runs: the two copies of every parameter (two stages) must be bitwise equal."""
    import torch

    copies: dict[str, list[tuple[str, Any]]] = {}
    for r in results:
        for key, w in r.get("weights", {}).items():
            name, tp, stage = key.split("#")
            copies.setdefault(f"{name}#{tp}", []).append((stage, w))
    problems = []
    for key, found in sorted(copies.items()):  # 2 copies; a tied embedding 4 (each replica's two ends)
        if len(found) < 2:
            problems.append(f"{key}: {len(found)} copy only, expected one per replica")
        for stage, w in found[1:]:
            if not torch.equal(found[0][1], w):
                diff = float((found[0][1] - w).abs().max())
                problems.append(f"{key}: copies {found[0][0]} and {stage} differ after training (max {diff:g})")
    return problems


def assemble(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per iteration, ``name#tp`` -> the whole gradient, put together from what the ranks report
    (data-parallel copies and the tied embedding's copies overwrite each other; distributed-optimizer
    shards fill their ranges)."""
    import torch

    out: list[dict[str, Any]] = []
    for it in range(len(results[0]["grads"])):
        full: dict[str, Any] = {}
        for r in results:
            for key, g in r["grads"][it].items():
                parts = key.split("#")
                name = "#".join(parts[:2])
                if len(parts) <= 4:
                    full[name] = g
                    continue
                lo, hi = (int(x) for x in parts[4].split(":"))
                flat = full.setdefault(name, {})
                flat[(lo, hi)] = g.reshape(-1)
        for name, value in full.items():
            if isinstance(value, dict):  # shards: concatenated in range order
                full[name] = torch.cat([value[k] for k in sorted(value)])
        out.append(full)
    return out


def compare(
    name: str,
    p: int,
    m: int,
    v: int,
    ref: list[dict[str, Any]],
    run: list[dict[str, Any]],
    tol: float | None = None,
    exact: list[dict[str, Any]] | None = None,
) -> VerifyReport:
    """Compare a pipeline run with megatron's fp32 reference ``ref`` and, for the derived verdict
    (:mod:`.criterion`), the float64 run ``exact`` (all already checked for errors). With ``tol`` the
    verdict is instead ``max_rel_grad_diff <= tol`` (and the losses within ``tol`` relative)."""
    if tol is None and exact is None:
        raise ValueError("compare() needs the exact (float64) run for the derived verdict, or an explicit tol")
    ref_losses = _losses(ref)
    run_losses = _losses(run)
    problems: list[str] = []
    problems += _replica_copies_differ(run)
    loss_diff, losses_equal = _loss_diff(run_losses, ref_losses, problems)
    ref_grads = assemble(ref)
    grad_diff, grads_equal = _grad_diff(run, ref_grads)
    bitwise = losses_equal and grads_equal
    verdict = None
    if exact is not None:
        exact_full = assemble(exact)
        exact_losses = _losses(exact)
        ours, missing = criterion.gradient_errors(exact_full, run)
        theirs, _ = criterion.gradient_errors(exact_full, ref)
        ours.update(criterion.loss_errors(exact_losses, run_losses))
        theirs.update(criterion.loss_errors(exact_losses, ref_losses))
        problems += missing
        verdict = criterion.judge(ours, theirs)
        problems += verdict.problems
    if tol is not None:
        covered = {"#".join(k.split("#")[:2]) for r in run for k in (r["grads"][0] if r["grads"] else {})}
        missing_names = sorted(set(ref_grads[0]) - covered) if ref_grads else []
        if missing_names:
            problems.append(f"parameters never produced a gradient on any rank: {missing_names[:5]}")
        ok = (
            not problems
            and grad_diff <= tol
            and loss_diff <= tol * max(1.0, abs(ref_losses[0][0]) if ref_losses[0] else 1.0)
        )
    else:
        assert verdict is not None
        ok = not problems and verdict.ok
    traces = [
        r.get("trace")
        for r in sorted(run, key=lambda r: (r["pp_rank"], r["tp_rank"]))
        if r["tp_rank"] == 0 and r.get("dp_rank", 0) == 0
    ]
    return VerifyReport(
        schedule=name,
        p=p,
        m=m,
        v=v,
        ok=ok,
        max_rel_grad_diff=grad_diff,
        max_abs_loss_diff=loss_diff,
        bitwise_equal=bitwise and not problems,
        iterations=len(run_losses),
        losses=[sum(x) / len(x) if x else float("nan") for x in run_losses],
        peak_activation_bytes=[t["peak_activation_bytes"] for t in traces if t],
        stage_activation_bytes=[{int(k): int(b) for k, b in t["stage_activation_bytes"].items()} for t in traces if t],
        measured_bubble_rate=[t["measured_bubble_rate"] for t in traces if t],
        collectives=[_launches(t) for t in traces if t],
        problems=problems,
        tolerance=tol,
        worst_ratio=None if verdict is None else verdict.worst_ratio,
        margin=None if verdict is None else verdict.margin,
        verdict="" if verdict is None else verdict.describe(),
    )


def _loss_diff(run_losses: list[list[float]], ref_losses: list[list[float]], problems: list[str]) -> tuple[float, bool]:
    """The largest absolute loss difference to the reference and whether every loss is equal bit for bit
    (an iteration with another number of losses goes to ``problems``)."""
    loss_diff = 0.0
    bitwise = True
    for it, (a, b) in enumerate(zip(run_losses, ref_losses, strict=True)):
        if len(a) != len(b):
            problems.append(f"iteration {it}: {len(a)} losses reported, reference has {len(b)}")
            continue
        for x, y in zip(a, b, strict=True):
            loss_diff = max(loss_diff, abs(x - y))
            bitwise &= x == y
    return loss_diff, bitwise


def _grad_diff(run: list[dict[str, Any]], ref_grads: list[dict[str, Any]]) -> tuple[float, bool]:
    """The largest gradient difference to the reference (relative to the reference's largest element, per
    tensor or shard) and whether every gradient is equal bit for bit."""
    import torch

    grad_diff = 0.0
    bitwise = True
    for r in run:
        for it, step in enumerate(r["grads"]):
            for key, g in step.items():
                parts = key.split("#")
                want = ref_grads[it].get("#".join(parts[:2]))
                if want is None:
                    continue  # reported by the criterion (or below, for a fixed tolerance)
                if len(parts) > 4:  # a shard of the flattened gradient (distributed optimizer)
                    lo, hi = (int(x) for x in parts[4].split(":"))
                    want = want.reshape(-1)[lo:hi]
                if g.shape != want.shape:
                    continue
                scale = max(float(want.abs().max()), 1e-30)
                grad_diff = max(grad_diff, float((g - want).abs().max()) / scale)
                bitwise &= bool(torch.equal(g, want))
    return grad_diff, bitwise


def check_bitwise(
    report: VerifyReport, native: list[dict[str, Any]], run: list[dict[str, Any]], combined: bool = False
) -> None:
    """A run of megatron's own order against megatron's own schedule on the same ranks: the arithmetic is the
    same operation for operation, so every loss and gradient must be equal bit for bit. ``native`` is
    megatron's 1F1B, or with ``combined`` its interleaved combined 1F1B (MoE all-to-all overlap), whose
    combined steps (which forward ran with which backward, :mod:`.combined_steps`) ours must also repeat."""
    import torch

    def by_rank(results: list[dict[str, Any]]) -> dict[tuple[int, int, int], dict[str, Any]]:
        return {(r["pp_rank"], r["tp_rank"], r.get("dp_rank", 0)): r for r in results}

    theirs, ours = by_rank(native), by_rank(run)
    differ = [
        f"rank {where}: {name}"
        for where, r in sorted(ours.items())
        for it, step in enumerate(r["grads"])
        for name, g in step.items()
        if where not in theirs or not torch.equal(g, theirs[where]["grads"][it].get(name, torch.empty(0)))
    ]
    differ += [f"rank {w}: losses" for w, r in sorted(ours.items()) if r["losses"] != theirs.get(w, {}).get("losses")]
    what = "megatron's interleaved combined 1F1B" if combined else "megatron's own 1F1B"
    if combined:
        report.bitwise_megatron_combined = not differ
        report.problems += _steps_differ(theirs, ours)
    else:
        report.bitwise_megatron_1f1b = not differ
    if differ:
        report.problems.append(f"not bitwise equal to {what} on the same ranks: {differ[:4]}")
    report.ok = report.ok and not report.problems


def _steps_differ(theirs: dict[Any, dict[str, Any]], ours: dict[Any, dict[str, Any]]) -> list[str]:
    """Per rank whose overlapped steps (per iteration, ``(forward, backward)`` with both sides, each
    ``(chunk, micro-batch)``) are not megatron's interleaved combined 1F1B's, or were not recorded: where they
    first differ. Only the steps with both sides count: megatron runs a lone forward or backward as a
    one-sided combined step, ours runs it plainly unless its micro-batch is paired on that stage."""
    problems = []

    def paired(record: dict[str, Any]) -> list[list[Any]]:
        return [
            [s for s in steps if s[0] is not None and s[1] is not None] for steps in record.get("combined_steps") or []
        ]

    for where, r in sorted(ours.items()):
        mine, megatron = paired(r), paired(theirs.get(where, {}))
        if mine and mine == megatron:
            continue
        at = ""
        for it, (a, b) in enumerate(zip(mine, megatron, strict=False)):
            if a != b:
                k = next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
                ours_k, theirs_k = (steps[k] if k < len(steps) else "nothing" for steps in (a, b))
                at = f" in iteration {it} from step {k}: ours {ours_k}, megatron {theirs_k}"
                break
        problems.append(f"rank {where}: combined steps differ from megatron's interleaved combined 1F1B{at}")
    return problems


def _launches(trace: dict[str, Any]) -> list[str]:
    last = trace["per_iteration"][-1] if trace.get("per_iteration") else {}
    return [
        f"{c['kind']}[s{c['stage']}]{' (overlaps backward)' if c['before_last_backward_end'] else ''}"
        for c in last.get("collectives", [])
    ]


def check_fsdp_collectives(
    report: VerifyReport, schedule: Any, run: list[dict[str, Any]], limit: int, unit: int | None
) -> None:
    """FSDP: every rank gathered its chunks and reduce-scattered their gradients exactly as often per
    iteration as the lowering derived, counted twice: by the chunks (``ShardedChunk`` counters) and by the
    trace (the executor's launches of derived ``reduce-grads``)."""
    from ..schedules.collectives import CollectiveKind, derive_collectives, fsdp_policy

    plan = derive_collectives(schedule, fsdp_policy(schedule, limit, unit))
    for r in sorted(run, key=lambda r: (r["pp_rank"], r["dp_rank"], r["tp_rank"])):
        where = f"pipeline rank {r['pp_rank']} dp rank {r['dp_rank']}"
        derived = plan.count(CollectiveKind.UNSHARD, r["pp_rank"])
        derived_reduces = plan.count(CollectiveKind.REDUCE_GRADS, r["pp_rank"])
        measured = r["fsdp"]["all_gathers_per_iteration"]
        reduces = r["fsdp"]["reduce_scatters_per_iteration"]
        trace = r.get("trace")
        traced = (
            [it["collective_counts"].get(str(CollectiveKind.REDUCE_GRADS), 0) for it in trace["per_iteration"]]
            if trace
            else None
        )
        if r["dp_rank"] == 0 and r["tp_rank"] == 0:
            report.fsdp.append(
                {
                    "derived_unshards": derived,
                    "derived_reduce_scatters": derived_reduces,
                    "traced_reduce_scatters_per_iteration": traced,
                    **r["fsdp"],
                }
            )
        if any(n != derived for n in measured):
            report.problems.append(
                f"{where}: {measured} parameter all-gathers per iteration, the lowering derived {derived}"
            )
        if any(n != derived_reduces for n in reduces) or (
            traced is not None and traced != [derived_reduces] * len(traced)
        ):
            report.problems.append(
                f"{where}: {reduces} gradient reduce-scatters per iteration (traced launches {traced}), the lowering "
                f"derived {derived_reduces}"
            )
    if report.problems:
        report.ok = False
