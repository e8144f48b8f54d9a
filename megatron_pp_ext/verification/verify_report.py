"""The report of a verification run: :class:`VerifyReport` (what :mod:`.compare` found) and its text, as
``megatron-pp verify`` prints it (:func:`report_lines`, and :func:`post_validation_lines` for
``--post-validation``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .post_validation_check import PostValidationReport


@dataclass
class VerifyReport:
    schedule: str
    p: int
    m: int
    v: int
    ok: bool
    max_rel_grad_diff: float  # to megatron's fp32 reference, largest over tensors of max|diff| / max|reference|
    max_abs_loss_diff: float
    bitwise_equal: bool  # every loss and gradient bitwise equal to megatron's fp32 reference
    iterations: int
    losses: list[float]
    peak_activation_bytes: list[int] = field(default_factory=list)
    # per pipeline rank: the measured bytes of one activation of each of its stages ({stage: bytes})
    stage_activation_bytes: list[dict[int, int]] = field(default_factory=list)
    measured_bubble_rate: list[float] = field(default_factory=list)
    # per pipeline rank (data-parallel replica 0): the derived collectives launched in the last
    # iteration, in order, each with whether it started before the rank's last backward ended
    collectives: list[list[str]] = field(default_factory=list)
    # FSDP runs, per pipeline rank: gathers derived vs measured per iteration, peak bytes held
    fsdp: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    # None: the derived criterion (criterion.py) decided; a number: the explicit fixed bound on max_rel_grad_diff
    tolerance: float | None = None
    # the derived criterion's outcome: worst ratio of our error to megatron fp32's (allowed: criterion.GROWTH)
    worst_ratio: float | None = None
    margin: float | None = None  # criterion.GROWTH / worst_ratio: > 1 inside the allowance
    verdict: str = ""  # one line: where the worst tensor is and by how much
    # schedules running megatron's own 1F1B order: every loss and gradient bitwise equal to megatron's 1F1B on
    # the same ranks (None: not that order, or not compared)
    bitwise_megatron_1f1b: bool | None = None
    # overlapped runs (MoE all-to-all overlap) of megatron's interleaved 1F1B order: every loss and gradient
    # bitwise equal to megatron's interleaved combined 1F1B on the same ranks, and the same combined steps
    bitwise_megatron_combined: bool | None = None

    def to_json_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """The criterion and its outcome, one line."""
        if self.tolerance is not None:
            return f"max rel grad diff {self.max_rel_grad_diff:.2g} (fixed tolerance {self.tolerance:g})"
        bitwise = "; bitwise equal to megatron's fp32" if self.bitwise_equal else ""
        if self.bitwise_megatron_1f1b is not None:
            same = "bitwise equal to" if self.bitwise_megatron_1f1b else "NOT bitwise equal to"
            bitwise += f"; {same} megatron's own 1F1B on the same ranks (same arithmetic, demanded)"
        if self.bitwise_megatron_combined is not None:
            same = "bitwise equal to" if self.bitwise_megatron_combined else "NOT bitwise equal to"
            bitwise += f"; {same} megatron's interleaved combined 1F1B on the same ranks (same steps, demanded)"
        return f"derived criterion: {self.verdict}{bitwise}"


def report_lines(report: VerifyReport) -> list[str]:
    """The verdict line, then the figures behind it, one line each (``megatron-pp verify``'s output)."""
    status = "OK" if report.ok else "MISMATCH"
    lines = [
        f"{status}: {report.schedule} p={report.p} m={report.m} v={report.v}, {report.iterations} iterations: "
        f"{report.describe()}",
        f"  to megatron's fp32 reference: max rel grad diff {report.max_rel_grad_diff:.3g}, "
        f"max abs loss diff {report.max_abs_loss_diff:.3g}",
        f"  losses per iteration: {', '.join(f'{x:.6f}' for x in report.losses)}",
        f"  peak activation bytes per rank: {report.peak_activation_bytes}",
        f"  measured bubble rate per rank: {[round(x, 3) for x in report.measured_bubble_rate]}",
    ]
    for rank, launches in enumerate(report.collectives):
        lines.append(f"  rank {rank} collectives (last iteration): {launches}")
    for rank, info in enumerate(report.fsdp):
        lines.append(
            f"  rank {rank} FSDP: {info['derived_unshards']} gathers derived, measured per iteration "
            f"{info['all_gathers_per_iteration']}; {info['derived_reduce_scatters']} gradient reduce-scatters "
            f"derived, measured {info['reduce_scatters_per_iteration']}; peak bytes {info['peak_bytes']}"
        )
    lines += [f"  problem: {problem}" for problem in report.problems]
    return lines


def post_validation_lines(pv: PostValidationReport) -> list[str]:
    """``megatron-pp verify --post-validation``'s verdict line and one line per stage."""
    status = "OK" if pv.ok else "MISMATCH"
    lines = [
        f"{status}: post-validation, {pv.compared} parameters after {pv.iterations} steps "
        f"{'bitwise equal to' if pv.bitwise_equal else 'differ from'} megatron's synchronous step "
        f"(max abs diff {pv.max_abs_weight_diff:.3g}); rollbacks {pv.rollbacks}, redone steps {pv.redos}, "
        f"iterations run again {pv.stats[0].get('reruns', 0) if pv.stats else 0}"
    ]
    for stage, stats in enumerate(pv.stats):
        lines.append(
            f"  stage {stage}: eager {stats['eager']}, rollbacks {stats['rollbacks']}, redone {stats['redos']}, "
            f"snapshot {stats['snapshot_bytes']} bytes"
        )
    lines += [f"  problem: {problem}" for problem in pv.problems]
    return lines
