"""Generated schedules on disk, across planner runs (``--cache``, ``--no-cache``)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from ..schedules import registry
from ..schedules.ir import ScheduleError
from ..schedules.schedule import Schedule

DISK_CACHE_MIN_SECONDS = 0.05  # only generators slower than this are worth a disk cache entry


class ScheduleCache:
    """Generated schedules on disk (CSV), so that slow generators (greedy, cost-aware) run once per
    ``(name, p, m, v, memory limit, costs)`` across planner runs. Entries are keyed by a hash of the
    key and of every source file of ``megatron_pp_ext.schedules``: editing a generator invalidates
    them. A refusal is stored as its message."""

    def __init__(self, directory: str | Path) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.version = _schedules_source_hash()

    def _path(self, key: tuple[Any, ...]) -> Path:
        digest = hashlib.sha1(repr((self.version, key)).encode()).hexdigest()[:24]
        return self.dir / f"{key[0]}-p{key[1]}-m{key[2]}-{digest}"

    def load(self, key: tuple[Any, ...]) -> Schedule | str | None:
        base = self._path(key)
        try:
            if base.with_suffix(".csv").exists():
                return Schedule.from_csv(base.with_suffix(".csv").read_text(), source=str(base))
            if base.with_suffix(".err").exists():
                return base.with_suffix(".err").read_text().strip() or "not applicable"
        except (OSError, ScheduleError):
            return None
        return None

    def store(self, key: tuple[Any, ...], value: Schedule | str) -> None:
        base = self._path(key)
        try:
            if isinstance(value, Schedule):
                tmp = base.with_suffix(".tmp")
                tmp.write_text(value.to_csv())
                tmp.replace(base.with_suffix(".csv"))
            else:
                base.with_suffix(".err").write_text(value + "\n")
        except OSError:
            pass


def _schedules_source_hash() -> str:
    package = Path(registry.__file__).resolve().parent
    digest = hashlib.sha1()
    for path in sorted(package.rglob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "megatron-pp" / "schedules"
