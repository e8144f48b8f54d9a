"""``megatron-pp verify``: run a schedule on real ranks and compare with a reference (needs the runtime).

The command's parser and its run live next to this module, in :mod:`.verify_command`
(``add_verify_parser(subparsers) -> None`` adds the ``verify`` parser and sets ``func``, a callable
``(args) -> exit code``, as its default); it reaches the runtime (torch + megatron-core), so it is imported
only when the command line asks for ``verify`` and no other command imports torch. Where the runtime does
not import, a stub parser says what is missing when run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from ..schedule_args import PROG
from .support import EXIT_USAGE


def add_parser(subparsers: Any, load_runtime: bool) -> None:
    """The runtime's ``verify`` parser when ``load_runtime`` and the runtime imports, else the stub."""
    reason = "not requested"
    if load_runtime:
        try:
            from .verify_command import add_verify_parser
        except ImportError as exc:
            reason = str(exc)
        else:
            add_verify_parser(subparsers)
            return
    stub = subparsers.add_parser(
        "verify", help="run a schedule on real ranks and compare with a reference (needs the runtime)"
    )
    stub.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    stub.set_defaults(func=lambda args: verify_unavailable(reason))


def verify_unavailable(reason: str) -> int:
    """The stub's answer: one line naming what is missing, exit code 2."""
    print(
        f"{PROG}: error: verify needs the megatron_pp_ext runtime (torch + megatron-core), not installed: {reason}",
        file=sys.stderr,
    )
    return EXIT_USAGE


def wants_verify(argv: Sequence[str]) -> bool:
    """Whether the command line's first positional word is ``verify`` (only then is the runtime loaded)."""
    positional = [a for a in argv if not a.startswith("-")]
    return bool(positional) and positional[0] == "verify"
