"""Marked blocks of a results file (benchmarks/RESULTS.md) that a benchmark's ``--write`` owns.

A block is the text between ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``. A benchmark replaces its own
block and leaves the rest of the file (hand-written prose, other benchmarks' blocks) as it is. Blocks may nest:
the emulated-compute section holds one block per pipeline shape. Pure text; no torch.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["block_markers", "replace_block", "write_block"]


def block_markers(name: str) -> tuple[str, str]:
    """The comment lines around block ``name``."""
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def _span(text: str, name: str) -> tuple[int, int] | None:
    """Where block ``name`` starts (its begin marker) and ends (after its end marker); None when absent.
    ValueError when its markers are not there once each, begin before end."""
    begin, end = block_markers(name)
    if begin not in text and end not in text:
        return None
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ValueError(f"the results file must hold {begin!r} once, then {end!r} once")
    return text.index(begin), text.index(end) + len(end)


def _anchor(text: str, anchor: str, name: str) -> tuple[int, int]:
    """The span of block ``anchor``, which block ``name`` is placed by; ValueError when it is absent."""
    span = _span(text, anchor)
    if span is None:
        raise ValueError(f"the results file has no block {anchor!r} to place {name!r} by")
    return span


def replace_block(text: str, name: str, body: str, *, inside: str | None = None, after: str | None = None) -> str:
    """``text`` with block ``name``'s contents replaced by ``body``.

    A block that is absent is added: at the end of block ``inside`` (just before its end marker), else just
    after block ``after``, else at the end of ``text``. ``inside`` and ``after`` name blocks that must exist
    then (ValueError otherwise), as must any block's markers be once each, begin before end.
    """
    begin, end = block_markers(name)
    block = f"{begin}\n{body.strip(chr(10))}\n{end}"
    span = _span(text, name)
    if span is not None:
        return text[: span[0]] + block + text[span[1] :]
    if inside is not None:
        at = _anchor(text, inside, name)[1] - len(block_markers(inside)[1])  # before its end marker
        return text[:at].rstrip("\n") + "\n\n" + block + "\n" + text[at:]
    if after is not None:
        at = _anchor(text, after, name)[1]
        return text[:at] + "\n\n" + block + text[at:]
    return (text.rstrip("\n") + "\n\n" if text.strip() else "") + block + "\n"


def write_block(path: str | Path, name: str, body: str, *, inside: str | None = None, after: str | None = None) -> None:
    """Replace (or add, as :func:`replace_block` places it) block ``name`` of the file ``path``; a missing
    file is created."""
    target = Path(path)
    old = target.read_text() if target.exists() else ""
    target.write_text(replace_block(old, name, body, inside=inside, after=after))
