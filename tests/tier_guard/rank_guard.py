"""The quick tier's guard: a test without the ``gloo`` marker may not start ranks.

Installed around every unmarked test by the root ``tests/conftest.py`` (in both tiers, so that CI catches a
missing marker too). A rank launch fails at once with one line naming the test and the launch, instead of running
for minutes in the fast tier:

* ``torch.distributed.init_process_group`` (any process group, even of one rank);
* a ``multiprocessing`` worker process (the rank pool spawns its ranks that way);
* a ``torchrun`` / ``python -m torch.distributed.run`` subprocess.

All three hold in the Python processes such a test starts as well (``sitecustomize.py`` next to this file is
put first on their ``PYTHONPATH``), so a CLI command run as a subprocess that spawns ranks is caught too.

Standard library only: it runs at the start of every guarded child interpreter.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable
from multiprocessing import process
from pathlib import Path
from typing import Any

ENV = "MEGATRON_PP_RANK_GUARD"  # the guarded test's node id, seen by child interpreters
HERE = str(Path(__file__).resolve().parent)
LAUNCHERS = ("torchrun", "torch.distributed.run")
C10D = "torch.distributed.distributed_c10d"


class UnmarkedRankLaunchError(RuntimeError):
    """A test without the ``gloo`` marker started ranks."""


def refusal(test: str, what: str) -> UnmarkedRankLaunchError:
    return UnmarkedRankLaunchError(
        f"{test} {what} but is not marked gloo: mark this test gloo (pytest.mark.gloo, or use a rank fixture "
        "tagged with tests.tiers.launches_ranks) so that the quick tier leaves it out"
    )


def is_rank_launch(args: Any) -> bool:
    """Whether a subprocess command line starts ranks through torchrun (a word ``torchrun``, a path ending in
    it, or ``-m torch.distributed.run``; a shell string is split into words)."""
    if isinstance(args, str | bytes | os.PathLike):
        words = os.fsdecode(args).split()
    else:
        words = [os.fsdecode(word) for word in args]
    return any(word in LAUNCHERS or os.path.basename(word) == "torchrun" for word in words)


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
    for name in (C10D, "torch.distributed"):
        if name in sys.modules:
            setattr_(sys.modules[name], "init_process_group", _refuse_process_group(test))


def _refuse_process_group(test: str) -> Callable[..., None]:
    def init_process_group(*args: Any, **kwargs: Any) -> None:
        raise refusal(test, "starts a process group")

    return init_process_group


class _C10dFinder(importlib.abc.MetaPathFinder):
    """In a child interpreter, where torch is imported later if at all: replace ``init_process_group`` as soon
    as ``torch.distributed.distributed_c10d`` is loaded (``torch.distributed`` copies it from there)."""

    def __init__(self, test: str) -> None:
        self.test = test

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != C10D:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module
        refuse = _refuse_process_group(self.test)

        def exec_module(module: Any) -> None:
            run(module)
            module.init_process_group = refuse

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install_from_env() -> None:
    """In a child interpreter started by a guarded test: the same guard, for the child's lifetime."""
    test = os.environ.get(ENV)
    if test:
        install(test, setattr)
        if C10D not in sys.modules:
            sys.meta_path.insert(0, _C10dFinder(test))
