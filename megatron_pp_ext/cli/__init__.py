"""``megatron-pp``: list, simulate, compare, validate, draw and verify pipeline schedules; plan, launch and
collect training runs. One module per command (its parser and what it does), :mod:`.main` the entry point,
:mod:`.formatting` the tables they print.

Pure Python on every path except ``verify`` and ``bench`` (torch, loaded only when asked for). Exit codes:
0 success, 1 an invalid schedule file (``validate``) or nothing to show (``plan``, ``collect``), 2 bad input
(unknown schedule, impossible parameters, unreadable file).
"""

from .main import build_parser, main

__all__ = ["build_parser", "main"]
