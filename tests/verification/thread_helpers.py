"""What a rank-pool worker still runs after its jobs (tests of resource leaks across reused workers)."""

from __future__ import annotations

import os


def gloo_threads() -> int:
    """gloo's network threads alive in this process (one per live process-group context)."""
    tasks = f"/proc/{os.getpid()}/task"
    names = []
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sum(name == "gloo_tcp_loop" for name in names)
