"""A benchmark's ``--write`` replaces only its own marked block of the results file (bench/results_file.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_pp_ext.bench.results_file import block_markers, replace_block, write_block


def test_replaces_only_its_block_and_appends_a_missing_one() -> None:
    begin, end = block_markers("demo")
    text = f"intro\n{begin}\nold figures\n{end}\nafter\n"
    new = replace_block(text, "demo", "new figures\n")
    assert new == f"intro\n{begin}\nnew figures\n{end}\nafter\n"
    assert replace_block(new, "demo", "new figures") == new  # idempotent
    assert replace_block("intro\n", "demo", "body") == f"intro\n\n{begin}\nbody\n{end}\n"


def test_a_missing_block_goes_inside_or_after_the_named_one() -> None:
    sb, se = block_markers("section")
    ob, oe = block_markers("other")
    text = f"{sb}\n## S\n{se}\n{ob}\nx\n{oe}\ntail\n"
    inside = replace_block(text, "p=2", "figures", inside="section")
    pb, pe = block_markers("p=2")
    assert inside == f"{sb}\n## S\n\n{pb}\nfigures\n{pe}\n{se}\n{ob}\nx\n{oe}\ntail\n"
    # A nested block is replaced where it is; the enclosing one is untouched.
    assert replace_block(inside, "p=2", "new", inside="section") == inside.replace("figures", "new")
    after = replace_block(text, "next", "y", after="section")
    nb, ne = block_markers("next")
    assert after == f"{sb}\n## S\n{se}\n\n{nb}\ny\n{ne}\n{ob}\nx\n{oe}\ntail\n"
    with pytest.raises(ValueError, match="no block 'missing'"):
        replace_block(text, "next", "y", after="missing")


@pytest.mark.parametrize("bad", ["{b}\n{b}\n{e}\n", "{e}\nx\n{b}\n", "{b}\nno end\n"])
def test_refuses_broken_markers(bad: str) -> None:
    begin, end = block_markers("demo")
    with pytest.raises(ValueError, match="once"):
        replace_block(bad.format(b=begin, e=end), "demo", "body")


def test_write_block_creates_then_replaces(tmp_path: Path) -> None:
    target = tmp_path / "RESULTS.md"
    write_block(target, "demo", "one")
    write_block(target, "demo", "two")
    begin, end = block_markers("demo")
    assert target.read_text() == f"{begin}\ntwo\n{end}\n"
