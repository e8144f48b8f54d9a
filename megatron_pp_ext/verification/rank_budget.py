"""How many local gloo rank processes ``verify`` may start on this machine, checked before any is spawned.

Each rank is a process importing torch and megatron-core (about 400 MB resident, measured: 365 MB after the
imports alone) that runs a tiny model and mostly waits on its peers, so memory is the hard limit and cores a
soft one: :data:`RANKS_PER_CORE` ranks per core is what the test suite runs (16 ranks on a 2-core machine).
``verify 1f1b -p 1000`` started 1000 such processes (400 GB) before this check.
"""

from __future__ import annotations

import os

__all__ = ["RANKS_PER_CORE", "RANK_BYTES", "check_local_ranks", "max_local_ranks"]

RANK_BYTES = 400 << 20  # resident memory of one verify rank (torch + megatron-core + the tiny model)
RANKS_PER_CORE = 8


def _available_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` (Linux), or None where there is none."""
    try:
        with open("/proc/meminfo") as stream:
            for line in stream:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def max_local_ranks() -> tuple[int, str]:
    """The largest rank count this machine takes, and the resource that sets it (for the message)."""
    cores = os.cpu_count() or 1
    by_cores = cores * RANKS_PER_CORE
    available = _available_bytes()
    by_memory = None if available is None else max(1, available // RANK_BYTES)
    if by_memory is not None and by_memory < by_cores:
        return by_memory, f"{available / (1 << 30):.1f} GiB available memory at ~{RANK_BYTES >> 20} MiB per rank"
    return by_cores, f"{cores} CPU cores x {RANKS_PER_CORE} ranks per core"


def check_local_ranks(ranks: int, flags: str) -> str | None:
    """``None`` when ``ranks`` processes fit on this machine, else the error line naming ``flags``."""
    limit, why = max_local_ranks()
    if ranks <= limit:
        return None
    return f"{flags} needs {ranks} local rank processes; this machine takes at most {limit} ({why})"
