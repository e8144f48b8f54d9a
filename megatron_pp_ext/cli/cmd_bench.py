"""``megatron-pp bench``: torch.distributed.pipelining's schedules next to ours in the simulator, or (with
``--emulate``) every schedule on real ranks with emulated compute."""

from __future__ import annotations

import argparse
from typing import Any

from .support import int_list

PEERS_BLOCK = "peers"  # the results file's block this command's --write replaces (analysis/peers.py builds it)


def cmd_bench(args: argparse.Namespace) -> int:
    """Peer tables: torch.distributed.pipelining's schedules next to ours (imports torch); with --emulate,
    every schedule on real ranks with emulated compute (bench/emulate_bench.py)."""
    from ..analysis import peers
    from ..bench import emulate_bench, real_peers_bench
    from ..bench.results_file import write_block

    real = real_peers_bench.settings_from(args)  # refuses its flags without --real-peers
    if real is not None:
        return real_peers_bench.main(real)
    if args.emulate:
        return emulate_bench.run(args)
    emulate_bench.settings_from(args)  # refuses the --emulate flags without --emulate
    args.p_list = args.p_list or "4,8,16,32"
    args.m_factors = args.m_factors or "1,2,3,4"
    command = "megatron-pp bench" + (f" -p {args.p_list}" if args.p_list != "4,8,16,32" else "")
    command += f" --m-factors {args.m_factors}" if args.m_factors != "1,2,3,4" else ""
    command += f" --write {args.write}" if args.write else ""
    command += f" --plots {args.plots}" if args.plots else ""
    text, rows = peers.report(int_list(args.p_list), int_list(args.m_factors), command)
    if args.plots:
        import os

        base = os.path.dirname(os.path.abspath(args.write)) if args.write else os.getcwd()
        for path in peers.plot_rows(rows, args.plots):
            text += f"\n\n![{path.stem}]({os.path.relpath(path.resolve(), base)})"
    if args.write:
        write_block(args.write, PEERS_BLOCK, text)
        print(f"wrote the peers section of {args.write}")
    else:
        print(text)
    return 0


def _add_emulate_arguments(bench: argparse.ArgumentParser) -> None:
    from ..bench.emulate_bench import add_arguments  # argument parsing only: no torch

    add_arguments(bench)


def _add_real_peers_arguments(bench: argparse.ArgumentParser) -> None:
    from ..bench.real_peers_bench import add_arguments  # argument parsing only: no torch

    add_arguments(bench)


def add_parser(subparsers: Any) -> None:
    """Adds ``bench`` to ``megatron-pp``'s sub-commands (its parser, with ``func`` set)."""
    bench = subparsers.add_parser("bench", help="torch.distributed.pipelining's schedules vs ours in the simulator")
    bench.add_argument("-p", dest="p_list", default=None, help="pipeline sizes, comma-separated (default 4,8,16,32)")
    bench.add_argument("--m-factors", default=None, help="m = factor * p for each factor (default 1,2,3,4)")
    bench.add_argument("--write", metavar="RESULTS.md", help="replace the peers section of this markdown file")
    bench.add_argument("--plots", metavar="DIR", help="also draw bubble-vs-m and peak-memory plots (matplotlib)")
    _add_emulate_arguments(bench)
    _add_real_peers_arguments(bench)
    bench.set_defaults(func=cmd_bench)
