"""Whether the training driver accepts every flag of a grid: the flags ``scripts/pretrain_gpt.py`` takes
(``megatron-pp grid --check``, tests/planner/test_slurm.py) and those a grid's job script passes."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from .children import run_child
from .grid import DEFAULT_SCRIPT, REPO_ROOT

__all__ = ["driver_flags", "flags_in_grid", "unknown_flags"]

# ---- static checks ------------------------------------------------------------------------------------
_FLAG = re.compile(r"(?<![A-Za-z0-9_-])(--[A-Za-z0-9][A-Za-z0-9_-]*)")


_PARSER_DUMP = """
import argparse, sys
sys.path.insert(0, {root!r})
from megatron_pp_ext.integration import cpu
cpu.enable_cpu_mode(force=True)
from megatron.training.arguments import add_megatron_arguments
import megatron_pp_ext
parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
parser = megatron_pp_ext.add_arguments(parser)
for action in parser._actions:
    for option in action.option_strings:
        print(option)
"""


_PIPED = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}


def driver_flags(
    script: str | Path = DEFAULT_SCRIPT, python: str = sys.executable, timeout: float = 600
) -> tuple[set[str], str]:
    """Flags ``script`` accepts, from ``python script --help``; ``(flags, how they were found)``.

    If ``--help`` fails (megatron-core 0.19.2's own parser cannot format its help: a ``%`` in
    the help of ``--moe-paged-stash-buffer-size-factor-cuda``), falls back to building the same
    parser the driver builds (megatron's ``add_megatron_arguments`` plus the plugin's
    ``add_arguments``) in a subprocess and listing its option strings."""
    env_cmd = [python, str(script), "--help"]
    try:
        code, out, err = run_child(env_cmd, timeout=timeout, **_PIPED)
        flags = set(_FLAG.findall(out or ""))
        if code == 0 and "--pipeline-schedule" in flags and "--num-layers" in flags:
            return flags, f"{Path(script).name} --help"
        why = ((err or "").strip().splitlines() or [f"exit code {code}"])[-1]
    except (OSError, subprocess.TimeoutExpired) as exc:
        why = str(exc)
    code, out, err = run_child([python, "-c", _PARSER_DUMP.format(root=str(REPO_ROOT))], timeout=timeout, **_PIPED)
    if code != 0:
        raise RuntimeError(f"cannot list the driver's flags: --help failed ({why}); parser dump failed: {err}")
    flags = {line.strip() for line in (out or "").splitlines() if line.strip().startswith("--")}
    return flags, f"parser introspection (megatron + plugin parsers; --help failed: {why})"


def flags_in_grid(grid_dir: str | Path) -> set[str]:
    """Every ``--flag`` the job script passes to the driver (common and per-configuration)."""
    grid = Path(grid_dir)
    text = (grid / "job.sbatch").read_text()
    start = text.index("COMMON_ARGS=(")
    common = text[start : text.index("\n)", start)]
    flags = set(_FLAG.findall(common))
    for line in (grid / "configs.tsv").read_text().splitlines()[1:]:
        flags |= set(_FLAG.findall(line.split("\t")[2]))
    return flags


def unknown_flags(grid_dir: str | Path, known: set[str]) -> list[str]:
    return sorted(flags_in_grid(grid_dir) - known)
