"""Check a driver's command line against megatron's parser plus the plugin's before megatron parses it.

megatron's ``parse_and_validate_args`` answers a mistyped flag or a bad value with its whole usage
text (~700 lines) on every rank. :func:`check_argv_or_exit` parses the same flags with a parser that
collects problems instead: one line per problem (an unknown flag with the closest known one, a bad
value with the flag's own message), printed by rank 0 only, and exit status 2 on every rank.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys
import time
from collections.abc import Callable, Sequence

__all__ = ["argv_problems", "check_argv_or_exit", "interleaving_problems", "layer_split_problems"]

MAX_PROBLEMS = 20
RANK0_GRACE_S = 3.0


class _ProblemError(Exception):
    pass


class _CollectingParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise _ProblemError(message)


def _megatron_parser() -> argparse.ArgumentParser:
    from megatron.training.arguments import add_megatron_arguments

    from .flags import add_arguments

    return add_arguments(add_megatron_arguments(_CollectingParser(allow_abbrev=False, add_help=False)))


def argv_problems(
    argv: Sequence[str], make_parser: Callable[[], argparse.ArgumentParser] = _megatron_parser
) -> list[str]:
    """One message per problem of ``argv`` (empty when megatron's parser will accept it)."""
    if any(a in ("-h", "--help") for a in argv):
        return []
    parser = make_parser()
    flags = sorted({o for action in parser._actions for o in action.option_strings if o.startswith("--")})
    rest, problems = list(argv), []
    for _ in range(MAX_PROBLEMS):
        try:
            _, unknown = parser.parse_known_args(rest)
        except _ProblemError as exc:
            message = str(exc)
            problems.append(message)
            # drop the offending flag (and its value) and parse again to find the next problem
            flag = message.split(":", 1)[0].removeprefix("argument ").split("/")[-1].strip()
            hits = [i for i, a in enumerate(rest) if a == flag or a.startswith(flag + "=")]
            if not flag.startswith("--") or not hits:
                return problems
            i = hits[0]
            del rest[i : i + (1 if "=" in rest[i] or i + 1 >= len(rest) or rest[i + 1].startswith("--") else 2)]
            continue
        previous_unknown = False
        for tok in unknown:
            if tok.startswith("-"):
                flag = tok.split("=", 1)[0]
                close = difflib.get_close_matches(flag, flags, n=1, cutoff=0.75)
                problems.append(f"unknown flag {flag}" + (f" (did you mean {close[0]}?)" if close else ""))
                previous_unknown = "=" not in tok
            elif not previous_unknown:
                problems.append(f"unexpected argument {tok!r}")
            else:
                previous_unknown = False
        return problems
    return problems


def _value(argv: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
    return None


def hybrid_pattern_problems(argv: Sequence[str]) -> list[str]:
    """What megatron's own validation would reject in ``--hybrid-layer-pattern`` with an assertion or a
    ValueError on every rank: a layer symbol it does not know, a segment count that is no multiple of
    ``--pipeline-model-parallel-size``. (Whether the segments fit the selected schedule's placement is
    checked after parsing, :func:`~.arguments.check_schedule_flags`.)"""
    from ..runtime.hybrid_pattern import HybridPatternError, pattern_segments

    flag = "--hybrid-layer-pattern"
    pattern = _value(argv, flag)
    if pattern is None:
        return []
    try:
        segments = pattern_segments(pattern.split("/")[0], flag)
    except HybridPatternError as exc:
        return [f"argument {flag}: {str(exc).removeprefix(flag + ' ')}"]
    p_text = _value(argv, "--pipeline-model-parallel-size") or "1"
    p = int(p_text) if p_text.isdigit() and int(p_text) > 0 else 1
    if len(segments) > 1 and len(segments) % p:
        return [
            f"argument {flag}: {pattern!r} has {len(segments)} segments: megatron needs a multiple of "
            f"--pipeline-model-parallel-size {p} (the segments are the pipeline stages, p x chunks per rank)"
        ]
    return []


def _int(argv: Sequence[str], flag: str) -> int | None:
    text = _value(argv, flag)
    return int(text) if text is not None and text.isdigit() else None


NO_OVERLAP = "--no-overlap-p2p-communication"


def interleaving_problems(argv: Sequence[str]) -> list[str]:
    """Where megatron's ``validate_args`` asserts, with a traceback, on the chunks per rank it derives: its
    virtual pipeline size (a layout string's stages over ``--pipeline-model-parallel-size``, or the virtual
    pipeline flags) above 1 needs a pipeline size above 2 without overlapped p2p
    (``--no-overlap-p2p-communication``), above 1 with it. A V / bidirectional schedule's layout string is
    hidden from that check (:func:`~.uneven.megatron_validation_for_placement`), so only the flags megatron
    sees count; ``--hybrid-layer-pattern`` is megatron's own."""
    from argparse import Namespace

    from ..schedules.values import parse_layer_layout
    from .uneven import selected_placement_style

    p = _int(argv, "--pipeline-model-parallel-size") or 1
    layout = _value(argv, "--pipeline-model-parallel-layout")
    style = selected_placement_style(
        Namespace(
            pipeline_schedule=_value(argv, "--pipeline-schedule"),
            pipeline_schedule_file=_value(argv, "--pipeline-schedule-file"),
        )
    )
    overlap = NO_OVERLAP not in argv
    least = 2 if overlap else 3  # the pipeline size megatron needs for more than one chunk per rank
    if layout is not None and style not in ("v", "bidirectional"):
        try:
            stages = len(parse_layer_layout(layout))
        except ValueError:
            return []  # the plugin's checks name a layout that does not parse
        if stages % p:
            return []  # megatron's own one-line assertion names the divisibility
        flag, chunks, given = "--pipeline-model-parallel-layout", stages // p, f"{layout!r} ({stages} stages)"
        sizes = [str(d) for d in range(least, stages + 1) if stages % d == 0]
        other = f"give --pipeline-model-parallel-size {' or '.join(sizes)}" if sizes else ""
        fewer = f"give a layout of {p} stage{'s' if p > 1 else ''}"
        fixes = [other, fewer]
    elif (v := _int(argv, "--num-virtual-stages-per-pipeline-rank")) is not None:
        flag, chunks, given = "--num-virtual-stages-per-pipeline-rank", v, str(v)
        fixes = [f"give --pipeline-model-parallel-size {least} or more", "leave the flag out"]
    else:
        return []  # (--num-layers-per-virtual-pipeline-stage: megatron's own arithmetic and messages)
    if chunks <= 1 or p >= least:
        return []
    why = "without pipeline parallelism" if overlap else f"with {NO_OVERLAP} at a pipeline size below 3"
    if not overlap:
        fixes.insert(0, f"leave out {NO_OVERLAP}")
    return [
        f"argument {flag}: {given} at --pipeline-model-parallel-size {p} means {chunks} interleaved chunks per "
        f"rank, which megatron's argument checks refuse {why} ({', or '.join(f for f in fixes if f)})"
    ]


def layer_split_problems(argv: Sequence[str]) -> list[str]:
    """Where megatron's ``validate_args`` asserts, with a traceback, that ``--num-layers`` (plus one for each
    ``--account-for-embedding/loss-in-pipeline-split``) divides by ``--pipeline-model-parallel-size``: with a
    plugin schedule of megatron's loop placement (or ``auto``, decided after megatron's checks), no uneven-split
    flags, no hybrid pattern and no virtual pipeline flag (megatron's other branch). V and bidirectional
    placements split the layers over their own model stages (:mod:`.uneven`), checked by the plugin."""
    from argparse import Namespace

    from .uneven import selected_placement_style

    schedule = _value(argv, "--pipeline-schedule")
    if schedule is None and _value(argv, "--pipeline-schedule-file") is None:
        return []
    style = selected_placement_style(
        Namespace(pipeline_schedule=schedule, pipeline_schedule_file=_value(argv, "--pipeline-schedule-file"))
    )
    if style in ("v", "bidirectional"):
        return []
    others = (
        "--decoder-first-pipeline-num-layers",
        "--decoder-last-pipeline-num-layers",
        "--pipeline-model-parallel-layout",
        "--hybrid-layer-pattern",
        "--num-virtual-stages-per-pipeline-rank",
        "--num-layers-per-virtual-pipeline-stage",
    )
    if any(_value(argv, flag) is not None for flag in others):
        return []
    layers, p = _int(argv, "--num-layers"), _int(argv, "--pipeline-model-parallel-size") or 1
    if layers is None or p <= 1:
        return []
    extra = [
        f for f in ("--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split") if f in argv
    ]
    counted = layers + len(extra)
    if counted % p == 0:
        return []
    what = f"{layers} layers" + "".join(f" + 1 ({f})" for f in extra)
    return [
        f"argument --num-layers: {what} do not split evenly over --pipeline-model-parallel-size {p} (megatron's "
        f"loop placement of {schedule or 'the schedule file'}): give a multiple of {p}, or "
        "--decoder-first/last-pipeline-num-layers for an uneven split"
    ]


def check_argv_or_exit(argv: Sequence[str], prog: str | None = None) -> None:
    """Exit with status 2 on every rank if ``argv`` has a problem; rank 0 prints one line per problem."""
    problems = (
        argv_problems(argv)
        or hybrid_pattern_problems(argv)
        or interleaving_problems(argv)
        or layer_split_problems(argv)
    )
    if not problems:
        return
    if os.environ.get("RANK", "0") == "0":
        name = prog or os.path.basename(sys.argv[0]) or "megatron"
        from .arguments import error_line

        for problem in problems:
            error_line(name, problem)
    else:
        time.sleep(RANK0_GRACE_S)  # torchrun stops every rank when one exits: let rank 0 print first
    raise SystemExit(2)
