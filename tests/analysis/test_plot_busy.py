"""The per-rank busy-time chart (analysis/plot.py ``draw_rank_busy``): one panel per schedule, a bar per layout
and rank, the prediction as a tick."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_pp_ext.analysis.plot import draw_rank_busy

PANELS = {
    "1f1b": {"uniform": ([4.0, 8.0], [4.2, 7.9]), "planned": ([6.0, 6.0], [6.1, 5.9])},
    "v-zb": {"uniform": ([8.0, 4.0], [8.0, 4.0]), "planned": ([6.0, 6.0], [6.0, 6.0])},
}


def test_it_draws_one_panel_per_schedule_and_a_bar_per_layout_and_rank(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = draw_rank_busy(PANELS, tmp_path / "busy.svg", "busy")
    svg = out.read_text()
    assert svg.count('<g id="axes_') == len(PANELS)
    bars = [f'id="busy-{i}-{j}-{r}"' for i in range(len(PANELS)) for j in range(2) for r in range(2)]
    assert all(svg.count(bar) == 1 for bar in bars)  # a bar per panel, layout and rank
    assert 'id="busy-0-2-0"' not in svg and 'id="busy-0-0-2"' not in svg


def test_it_refuses_a_format_it_does_not_draw(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"\.png or \.svg"):
        draw_rank_busy(PANELS, tmp_path / "busy.pdf", "busy")
