"""``megatron-pp list``: the registered schedules."""

from __future__ import annotations

import argparse
from typing import Any

from ..schedules import registry

LIST_WIDTH = 100  # `megatron-pp list` fits a 100-column terminal


def cmd_list(args: argparse.Namespace) -> int:
    """One line per schedule (name, placement, B/W split), then its description and constraints
    wrapped below it."""
    import textwrap

    infos = [registry.get(name) for name in registry.names()]
    name_w = max(len("name"), *(len(i.name) for i in infos))
    place_w = max(len("placement"), *(len(i.placement) for i in infos))
    indent = " " * 4
    print(f"{'name'.ljust(name_w)}  {'placement'.ljust(place_w)}  B/W split")
    print(f"{'-' * name_w}  {'-' * place_w}  ---------")
    for info in infos:
        print(f"{info.name.ljust(name_w)}  {info.placement.ljust(place_w)}  {'yes' if info.splits_backward else 'no'}")
        for text in (info.description, f"constraints: {info.requirements}"):
            print(textwrap.fill(text, LIST_WIDTH, initial_indent=indent, subsequent_indent=indent + "  "))
    return 0


def add_parser(subparsers: Any) -> None:
    """Adds ``list`` to ``megatron-pp``'s sub-commands (its parser, with ``func`` set)."""
    subparsers.add_parser("list", help="registered schedules").set_defaults(func=cmd_list)
