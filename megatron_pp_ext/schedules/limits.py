"""The size bounds of a schedule: how many ops one may have (generated, read from a file or simulated over
several iterations) and how many bytes a schedule file may hold, each checked before any work is sized by
the request, so that a huge number is one error line instead of minutes of work and gigabytes of memory.

Why these numbers: the largest configuration in this repository's published plans (``scripts/slurm``) has
24,576 ops (``p=32 x m=256``, F, B and W); :data:`MAX_OPS` is about 40 times that. A schedule at the
limit takes about 1 GB and 5-30 s to generate, validate and simulate on one CPU core (measured: ``1f1b -p 64
-m 5000``, 960,000 ops: 4.9 s, 510 MB; ``zb-auto -p 32 -m 10000``: 27 s, 600 MB), so no accepted request runs
away, and any real pipeline fits with room.
"""

from __future__ import annotations

from .ir import ScheduleError

__all__ = [
    "MAX_DRAWN_OPS",
    "MAX_FILE_BYTES",
    "MAX_OPS",
    "OPS_PER_PAIR",
    "ScheduleTooLargeError",
    "check_drawn_ops",
    "check_ops",
    "check_simulated_ops",
]

MAX_OPS = 1 << 20  # ops in one schedule, and op executions in one simulation (iterations x ops)
# ops in one Gantt chart (``draw``): measured on this project's CPU, 96,000 ops take about 10 s and 220 MB, 960,000
# take about 110 s and 1.2 GB (benchmarks/RESULTS.md); past about 100 boxes per inch of a 48-inch chart's width no box
# is visible anyway
MAX_DRAWN_OPS = 1 << 17
OPS_PER_PAIR = 3  # a (stage, micro-batch) pair runs F, B and W (at most: an unsplit backward is one op)
# Bytes per op a schedule file may spend on average (an op is written as e.g. "BW123.4567," in 11 bytes;
# headers and blank lines fit in the rest): a file of more bytes than this holds more ops than MAX_OPS.
MAX_FILE_BYTES = 16 * MAX_OPS


class ScheduleTooLargeError(ScheduleError):
    """A request over :data:`MAX_OPS` (names the sizes, the limit and why)."""


def check_ops(p: int, m: int, v: int) -> None:
    """Refuse building a schedule of ``p`` ranks x ``m`` micro-batches x ``v`` chunks per rank when its
    op count (``3 p m v``) is over :data:`MAX_OPS`; arbitrary-precision integers, so any size is cheap."""
    ops = OPS_PER_PAIR * p * m * v
    if ops > MAX_OPS:
        raise ScheduleTooLargeError(
            f"p={p} ranks x m={m} micro-batches x v={v} chunks (-p x -m x -v) is {_count(ops)} ops; the limit is "
            f"{MAX_OPS:,} ops ({OPS_PER_PAIR} per stage and micro-batch, about 1 GB and 5-30 s to simulate; the "
            "largest published plan here has 24,576)"
        )


def check_drawn_ops(num_ops: int) -> None:
    """Refuse drawing a chart of more than :data:`MAX_DRAWN_OPS` ops (names the count, the limit and its cost)."""
    if num_ops > MAX_DRAWN_OPS:
        raise ScheduleTooLargeError(
            f"the schedule has {num_ops:,} ops; draw charts at most {MAX_DRAWN_OPS:,} (about 15 s and 300 MB; a "
            f"chart of the 1,048,576-op limit takes about 2 minutes and 1.2 GB and shows no single box): give a "
            "smaller -p / -m, or use simulate"
        )


def check_simulated_ops(iterations: int, num_ops: int) -> None:
    """Refuse simulating ``iterations`` back-to-back iterations of a schedule of ``num_ops`` ops when the
    op executions exceed :data:`MAX_OPS` (the simulator keeps every one)."""
    total = iterations * num_ops
    most = max(1, MAX_OPS // max(num_ops, 1))
    if total > MAX_OPS:
        raise ScheduleTooLargeError(
            f"{iterations} iterations (--iterations) x {num_ops:,} ops is {_count(total)} simulated ops; the limit is "
            f"{MAX_OPS:,} (about 1 GB and 5-30 s on one CPU core): give at most --iterations {most}"
        )


def _count(n: int) -> str:
    """A count for a message: digits up to a trillion, else its power of ten (a 10**18 request stays short)."""
    return f"{n:,}" if n < 10**12 else f"~10^{len(str(n)) - 1}"
