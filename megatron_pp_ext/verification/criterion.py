"""The verdict of ``megatron-pp verify``: is a schedule's run as exact as megatron's own?

A pipeline schedule changes the order of the work, so in fp32 its gradients differ from an
unpartitioned run's by rounding: the per-micro-batch (and per-replica) partial gradients are summed
in another order and grouping. How large that rounding is depends on the CPU's kernels (AVX2 and
AVX-512 reduce in different orders), the thread count and the library version, so no fixed threshold
read off one machine separates "rounding" from "wrong" on every machine. The verdict is therefore
relative to an *exact* reference, measured on the machine that runs the check:

* **exact**: megatron-core's own no-pipelining schedule on the same model, data and initial weights,
  in float64 (cross-entropy included). Its own rounding is ~2^-53, nine orders below fp32's: for an
  fp32 run it is the true result.
* **reference**: megatron-core's own no-pipelining schedule in fp32 with the same data-parallel
  grouping as the run (``dp`` replicas, each summing its own micro-batches, reduced by megatron's
  DDP or distributed optimizer). Its distance to the exact result is what fp32 costs on this machine,
  for this model, with megatron's order: the noise a correct run is allowed.
* **ours**: the schedule under test, fp32.

For every iteration and every parameter tensor (and every iteration's losses) the normwise relative
distance to the exact result, ``e = ||x - exact|| / ||exact||``, is computed for ours and for the
reference. The run passes when, everywhere, ``e_ours <= GROWTH * max(e_reference, FP32_RESOLUTION)``.

Why this cannot fail a correct schedule: a correct schedule performs the same floating-point
operations as the reference except for the order of summing the same partial gradients, and the
rounding error of a sum has the same bound, ``gamma_(n-1) * sum |x_i|`` (Higham, *Accuracy and
Stability of Numerical Algorithms*, 2nd ed., §4.2), for every order, so its error is of the
reference's own size on whatever machine both run. ``GROWTH = 4`` covers the spread of the realized
error between two summation orders (normwise errors average over a tensor's elements: measured
ratios stay within 0.5-2, across AVX2/AVX-512/baseline kernels and one or two threads, see
``benchmarks/RESULTS.md``). ``FP32_RESOLUTION = 2^-23`` (one unit in the last place of fp32 at 1)
keeps a reference that happens to be nearly exact on a small tensor from demanding more than fp32
can express.

The optimizer of every run is Adam (torch's, or megatron's for the distributed optimizer) with
``eps = ADAM_EPS = 1``, far above every gradient element of the tiny model (~1e-2 and below). Its
update ``lr * m / (sqrt(v) + eps)`` is then a smooth function of the gradients, of slope at most
``lr / eps`` (SGD with momentum, in effect), so a rounding difference in a gradient stays a rounding
difference in the weights and in the next iterations. With Adam's default ``eps = 1e-8`` the update
of an element is ``±lr`` whatever its size once it exceeds ``1e-8``: a sign flip of a near-zero
element (pure rounding, different on AVX2 and AVX-512) becomes an ``O(lr)`` weight difference, and a
multi-step comparison measures the kernels' luck, not the schedule.

Why it cannot pass a wrong one: a schedule error changes some gradient by a whole contribution — a
micro-batch skipped, doubled or swapped (``~1/m`` of the tensor's norm), a weight gradient not or twice
applied, a data-parallel reduction missing or early (a replica's share), weights used before the
optimizer updated them (a step at ``LR = 0.1`` moves the tiny model's weights by 1-10%). These are
``>= 1e-3`` relative, while the allowance is ``GROWTH`` times fp32 rounding, ``~1e-6``: a margin of three
orders of magnitude, which :attr:`Verdict.margin` reports and the deliberate breaks of
``tests/verification/test_verify_breaks.py`` show.

An explicit tolerance (``--tolerance``) replaces the derived criterion by a fixed bound on the largest
relative gradient difference to megatron's fp32 reference, for users who want one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

GROWTH = 4.0
FP32_RESOLUTION = 2.0**-23
ADAM_EPS = 1.0  # every run of a verification: Adam's update smooth in the gradient (see above)
LR = 0.1  # one step moves the tiny model's weights by 1-10%: weights used before their update show
LOSSES = "losses"  # the name under which an iteration's losses are judged


@dataclass
class Verdict:
    """The derived criterion's outcome over all iterations and tensors."""

    ok: bool
    # the largest e_ours / max(e_reference, FP32_RESOLUTION) and where it was (iteration, tensor)
    worst_ratio: float
    worst_at: str
    worst_ours: float  # e_ours there
    worst_reference: float  # e_reference there
    problems: list[str] = field(default_factory=list)

    @property
    def margin(self) -> float:
        """How far the worst tensor is from the allowance: GROWTH / worst_ratio (>1: inside)."""
        return GROWTH / self.worst_ratio if self.worst_ratio > 0 else math.inf

    def describe(self) -> str:
        side = "inside" if self.ok else "OUTSIDE"
        return (
            f"worst {self.worst_at}: error {self.worst_ours:.2e} vs megatron fp32 {self.worst_reference:.2e} "
            f"(ratio {self.worst_ratio:.3g}, allowed {GROWTH:g}; {side} by x{max(self.margin, 1 / self.margin):.3g})"
        )


def gradient_errors(
    truth: list[dict[str, Any]], run: list[dict[str, Any]]
) -> tuple[dict[tuple[int, str], float], list[str]]:
    """Per (iteration, ``name#tp``): the normwise relative distance of ``run``'s gradient to the exact
    one (``truth``: per iteration, ``name#tp`` -> whole gradient). Every piece a rank reports counts
    (data-parallel copies, the tied embedding's two copies, distributed-optimizer shards): an element
    held twice counts with its worse copy."""
    import torch

    problems: list[str] = []
    worst: dict[tuple[int, str], Any] = {}  # per (it, name): elementwise worst |x - exact|, flattened
    covered: dict[tuple[int, str], Any] = {}
    for r in run:
        for it, step in enumerate(r["grads"]):
            for key, g in step.items():
                parts = key.split("#")
                name = "#".join(parts[:2])
                want = truth[it].get(name) if it < len(truth) else None
                if want is None:
                    problems.append(f"iteration {it}: parameter {name} has no reference counterpart")
                    continue
                flat = want.reshape(-1)
                lo, hi = (int(x) for x in parts[4].split(":")) if len(parts) > 4 else (0, flat.numel())
                if g.numel() != hi - lo or (len(parts) <= 4 and g.shape != want.shape):
                    problems.append(f"{name}: shape {tuple(g.shape)} vs reference {tuple(want.shape)}")
                    continue
                err = (g.detach().reshape(-1).double() - flat[lo:hi].double()).abs()
                cell = (it, name)
                if cell not in worst:
                    worst[cell] = torch.zeros_like(flat, dtype=torch.float64)
                    covered[cell] = torch.zeros(flat.numel(), dtype=torch.bool)
                worst[cell][lo:hi] = torch.maximum(worst[cell][lo:hi], err)
                covered[cell][lo:hi] = True
    errors: dict[tuple[int, str], float] = {}
    for it, names in enumerate(truth):
        for name, want in names.items():
            cell = (it, name)
            if cell not in worst or not bool(covered[cell].all()):
                problems.append(f"iteration {it}: no rank produced (all of) the gradient of {name}")
                continue
            errors[cell] = _relative(float(worst[cell].norm()), float(want.double().norm()))
    return errors, problems


def loss_errors(exact: list[list[float]], run: list[list[float]]) -> dict[tuple[int, str], float]:
    """Per iteration: the normwise relative distance of the run's micro-batch losses to the exact ones."""
    out: dict[tuple[int, str], float] = {}
    for it, (want, got) in enumerate(zip(exact, run, strict=True)):
        if len(want) == len(got):
            diff = math.sqrt(sum((a - b) ** 2 for a, b in zip(got, want, strict=True)))
            out[(it, LOSSES)] = _relative(diff, math.sqrt(sum(b * b for b in want)))
    return out


def judge(ours: dict[tuple[int, str], float], reference: dict[tuple[int, str], float]) -> Verdict:
    """``e_ours <= GROWTH * max(e_reference, FP32_RESOLUTION)`` for every (iteration, tensor)."""
    problems = [f"iteration {it}: {name} missing from the run" for it, name in sorted(set(reference) - set(ours))]
    worst = (0.0, "nothing compared", 0.0, 0.0)
    for cell, e in sorted(ours.items()):
        allowed_unit = max(reference.get(cell, 0.0), FP32_RESOLUTION)
        ratio = e / allowed_unit if math.isfinite(e) else math.inf
        if ratio > worst[0] or worst[1] == "nothing compared":
            worst = (ratio, f"iteration {cell[0] + 1} {cell[1]}", e, reference.get(cell, 0.0))
    ok = not problems and worst[0] <= GROWTH
    return Verdict(ok, worst[0], worst[1], worst[2], worst[3], problems)


def _relative(diff: float, norm: float) -> float:
    if norm > 0:
        return diff / norm
    return 0.0 if diff == 0 else math.inf
