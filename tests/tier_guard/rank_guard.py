"""The quick tier's guard: a test without the ``gloo`` marker may not start ranks.

Installed around every unmarked test by the root ``tests/conftest.py`` (in both tiers, so that CI catches a
missing marker too). A rank launch fails at once with one line naming the test and the launch, instead of running
for minutes in the fast tier:

* ``torch.distributed.init_process_group`` (any process group, even of one rank), in the test's process;
* a ``multiprocessing`` worker process (the rank pool spawns its ranks that way);
* a ``torchrun`` / ``python -m torch.distributed.run`` subprocess.

The last two hold in the Python processes such a test starts as well (``sitecustomize.py`` next to this file is
put first on their ``PYTHONPATH``), so a CLI command run as a subprocess that spawns ranks is caught too.

Standard library only: it runs at the start of every guarded child interpreter.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from multiprocessing import process
from pathlib import Path
from typing import Any

ENV = "MEGATRON_PP_RANK_GUARD"  # the guarded test's node id, seen by child interpreters
HERE = str(Path(__file__).resolve().parent)
LAUNCHERS = ("torchrun", "torch.distributed.run")


class UnmarkedRankLaunchError(RuntimeError):
    """A test without the ``gloo`` marker started ranks."""


def refusal(test: str, what: str) -> UnmarkedRankLaunchError:
    return UnmarkedRankLaunchError(
        f"{test} {what} but is not marked gloo: mark this test gloo (pytest.mark.gloo, or use a rank fixture "
        "tagged with tests.tiers.launches_ranks) so that the quick tier leaves it out"
    )


def is_rank_launch(args: Any) -> bool:
    """Whether a subprocess command line starts ranks through torchrun."""
    words = [args] if isinstance(args, str | bytes | os.PathLike) else list(args)
    text = " ".join(os.fsdecode(word) for word in words)
    return any(launcher in text for launcher in LAUNCHERS)


def guarded_env(env: dict[str, str] | None, test: str) -> dict[str, str] | None:
    """A child's environment with the guard switched on (``None``: the child inherits ``os.environ``)."""
    if env is None:
        return None
    path = [HERE, *(part for part in env.get("PYTHONPATH", "").split(os.pathsep) if part)]
    return {**env, ENV: test, "PYTHONPATH": os.pathsep.join(path)}


def install(test: str, setattr_: Callable[[Any, str, Any], None]) -> None:
    """Replace the launch points; ``setattr_`` is pytest's ``monkeypatch.setattr`` (undone after the test) or
    plain ``setattr`` in a child interpreter."""

    def start(self: Any) -> None:
        raise refusal(test, f"starts a worker process ({self.name})")

    popen_init = subprocess.Popen.__init__

    def popen(self: Any, args: Any, *rest: Any, **kwargs: Any) -> None:
        if is_rank_launch(args):
            raise refusal(test, "launches torchrun")
        if "env" in kwargs:
            kwargs["env"] = guarded_env(kwargs["env"], test)
        popen_init(self, args, *rest, **kwargs)

    setattr_(process.BaseProcess, "start", start)
    setattr_(subprocess.Popen, "__init__", popen)
    distributed = sys.modules.get("torch.distributed")
    if distributed is not None:

        def init_process_group(*args: Any, **kwargs: Any) -> None:
            raise refusal(test, "starts a process group")

        for module in _c10d_modules(distributed):
            setattr_(module, "init_process_group", init_process_group)


def _c10d_modules(distributed: Any) -> Iterable[Any]:
    yield distributed
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is not None:
        yield c10d


def install_from_env() -> None:
    """In a child interpreter started by a guarded test: the same guard, for the child's lifetime."""
    test = os.environ.get(ENV)
    if test:
        install(test, setattr)
