"""Gantt charts: every op kind drawn in its own colour, chunk shades, formats."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_pp_ext.analysis.plot import KIND_COLORS, draw, shade, title_for
from megatron_pp_ext.analysis.simulate import simulate
from megatron_pp_ext.schedules import B, F, OpKind, Schedule, W, build_schedule, generate, loop_placement
from megatron_pp_ext.schedules.costs import Costs


def split_backward_schedule() -> Schedule:  # a tiny ZB-H1-like order with B and W ops
    return build_schedule(
        "zb-by-hand",
        loop_placement(2),
        2,
        [
            [F(0, 0), F(0, 1), B(0, 0), W(0, 0), B(0, 1), W(0, 1)],
            [F(1, 0), B(1, 0), F(1, 1), B(1, 1), W(1, 0), W(1, 1)],
        ],
    )


def test_svg_has_a_colour_per_kind(tmp_path: Path) -> None:
    schedule = split_backward_schedule()
    result = simulate(schedule, Costs(1, 1, 1, None, 0.1))
    out = draw(result, schedule, tmp_path / "zb.svg")
    text = out.read_text()
    for kind in (OpKind.F, OpKind.B, OpKind.W):
        assert KIND_COLORS[kind] in text, kind
    assert KIND_COLORS[OpKind.BW] not in text
    assert "zb-by-hand: p=2 m=2 v=1" in text


def test_png_interleaved(tmp_path: Path) -> None:
    schedule = generate("interleaved-1f1b", 2, 2, v=2)
    result = simulate(schedule)
    out = draw(result, schedule, tmp_path / "il.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "p=2 m=2 v=2" in title_for(result, schedule)


def test_chunk_shades_lighten() -> None:
    first, last = shade(OpKind.F, 0, 3), shade(OpKind.F, 2, 3)
    assert sum(last) > sum(first)
    assert shade(OpKind.BW, 0, 1) == shade(OpKind.BW, 0, 4)
    assert len({shade(k, 0, 1) for k in OpKind}) == 4


def test_bad_suffix(tmp_path: Path) -> None:
    schedule = generate("1f1b", 2, 2)
    with pytest.raises(ValueError, match=r"\.png or \.svg"):
        draw(simulate(schedule), schedule, tmp_path / "x.jpg")


def test_a_large_chart_draws_one_collection_per_rank_and_colour_and_caps_its_labels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chart of tens of thousands of ops used to take minutes: one bar artist and one text per op. Bars are
    now one collection per rank and colour, and past MAX_LABELS the micro-batch labels are left out (said so)."""
    from matplotlib.axes import Axes

    from megatron_pp_ext.analysis import plot

    calls = {"broken_barh": 0, "barh": 0, "text": 0}
    for name in calls:
        real = getattr(Axes, name)

        def counted(self: Axes, *args: object, _name: str = name, _real: object = real, **kwargs: object) -> object:
            calls[_name] += 1
            return _real(self, *args, **kwargs)  # type: ignore[operator]

        monkeypatch.setattr(Axes, name, counted)
    schedule = generate("zb-h1", 2, 8)
    result = simulate(schedule)
    text = draw(result, schedule, tmp_path / "small.svg").read_text()
    assert calls["barh"] == 0 and calls["broken_barh"] == 2 * 3  # 2 ranks x (F, B, W)
    assert calls["text"] == 3 * 2 * 8 and "box label = micro-batch" in text  # every op labelled
    monkeypatch.setattr(plot, "MAX_LABELS", 10)
    calls["text"] = 0
    text = draw(result, schedule, tmp_path / "large.svg").read_text()
    assert calls["text"] == 0 and "micro-batch labels left out (over 10 boxes)" in text
