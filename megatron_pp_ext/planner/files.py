"""Reading the planner's input files (run logs, plan documents) with a size cap counted while reading: a
device, a pipe or a huge file is one error line naming the file, not a read that never ends."""

from __future__ import annotations

from pathlib import Path

__all__ = ["MAX_LOG_BYTES", "MAX_PLAN_BYTES", "read_capped"]

MAX_LOG_BYTES = 256 << 20  # a run's log is a few MB (a line per iteration)
MAX_PLAN_BYTES = 64 << 20  # a plan is ~1 KB per configuration: 64 MiB is tens of thousands of them


def read_capped(path: str | Path, limit: int, what: str) -> str:
    """The text of ``path`` (undecodable bytes replaced), or ValueError naming ``what``, the file and the
    cause: unreadable, a directory, a dangling symbolic link, or more than ``limit`` bytes."""
    file = Path(path)
    try:
        with file.open("rb") as stream:
            data = stream.read(limit + 1)
    except OSError as exc:
        cause = "a dangling symbolic link" if file.is_symlink() and not file.exists() else exc.strerror or str(exc)
        raise ValueError(f"cannot read {what} {file}: {cause}") from None
    if len(data) > limit:
        raise ValueError(f"{what} {file} has more than {limit >> 20} MiB: not a {what} of megatron-pp")
    return data.decode("utf-8", errors="replace")
