"""`megatron-pp draw --html`: the data behind the page, and the page itself in a real headless browser."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from megatron_pp_ext.analysis import simulate
from megatron_pp_ext.analysis.html import KINDS, build_variants, render, variant_data
from megatron_pp_ext.analysis.peers import ours, stage_costs
from megatron_pp_ext.analysis.schedule_check import validate
from megatron_pp_ext.cli import main


@pytest.mark.parametrize(("name", "p", "m"), [("1f1b", 4, 8), ("interleaved-1f1b", 4, 8), ("v-zb", 4, 8)])
def test_memory_curve_peaks_at_the_simulators_peak(name: str, p: int, m: int) -> None:
    schedule = ours(name, p, m, "profiled")
    chunks = round(schedule.placement.stages_per_rank_per_replica)
    result = simulate(schedule, stage_costs("profiled", chunks), lowered=validate(schedule))
    data = variant_data(schedule, result)
    for rank, row in enumerate(data["ranks"]):  # type: ignore[arg-type]
        assert max(v for _, v in row["memory"]) == pytest.approx(result.peak_activations_1f1b_units[rank])
        assert row["memory"][-1][1] == pytest.approx(0.0)  # everything freed by the end
        assert [f"{KINDS[o[0]]}{o[1]}.{o[2]}" for o in row["ops"]] == [str(op) for op in schedule.ops[rank]]


def test_page_is_self_contained() -> None:
    page = render(build_variants(["1f1b"], [(2, 2)], ["unit"]))
    for remote in ("http://", "https://", "src=", "@import", "//cdn"):
        if remote == "http://":  # the SVG namespace URI is an identifier, not a fetch
            assert page.count(remote) == page.count("http://www.w3.org/2000/svg")
        else:
            assert remote not in page


def test_refused_variant_is_listed_not_fatal() -> None:
    variants = build_variants(["interleaved-1f1b"], [(4, 2)], ["unit"])  # m < p: the generator refuses
    assert "error" in variants["interleaved-1f1b|4|2|unit"]


# ---- the page in a real browser ------------------------------------------------------------------
def _browser() -> str | None:
    for candidate in (os.environ.get("CHROMIUM"), "chromium", "chromium-browser", "google-chrome"):
        if candidate and shutil.which(candidate):
            return shutil.which(candidate)
    return None


def _skip_reason() -> str | None:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "Playwright for Python is not installed (pip install playwright)"
    if _browser() is None:
        return "no chromium binary on PATH (Debian: apt-get install chromium; or set CHROMIUM=/path/to/chrome)"
    return None


@pytest.mark.skipif(_skip_reason() is not None, reason=str(_skip_reason()))
@pytest.mark.slow  # a browser
def test_page_in_headless_chromium(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from playwright.sync_api import sync_playwright

    out = tmp_path / "explorer.html"
    argv = ["draw", "--html", "-o", str(out), "--html-schedules", "1f1b,v-zb", "--html-p", "4"]
    assert main([*argv, "--html-m-factors", "1,2"]) == 0
    capsys.readouterr()
    schedule = ours("1f1b", 4, 4, "unit")  # the first variant in every select: 1f1b, p=4, m=4, unit costs
    expected = variant_data(schedule, simulate(schedule, stage_costs("unit", 1)))["ranks"][1]["ops"][2]  # type: ignore[index]

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=_browser(), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            errors: list[str] = []
            page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(out.as_uri())
            assert page.get_attribute("#gantt", "data-variant") == "1f1b|4|4|unit"
            assert page.locator("rect.op").count() == 4 * 4 * 2

            page.hover('rect.op[data-rank="1"][data-index="2"]')
            assert page.is_visible("#tooltip")
            shown = {k: page.text_content(f"#tt-{k}") for k in ("op", "rank", "stage", "mb", "chunk", "start", "end")}
            kind, stage, mb, chunk, start, end, mem = expected
            assert shown == {
                "op": f"{KINDS[kind]}{stage}.{mb}",
                "rank": "1",
                "stage": str(stage),
                "mb": str(mb),
                "chunk": str(chunk),
                "start": f"{start:g}",
                "end": f"{end:g}",
            }
            assert float(page.text_content("#tt-mem") or "nan") == pytest.approx(mem)

            page.select_option("#sel-schedule", "v-zb")
            page.select_option("#sel-m", "8")
            assert page.get_attribute("#gantt", "data-variant") == "v-zb|4|8|unit"
            assert page.locator("rect.op").count() == 8 * 8 * 3  # 2p stages x m x (F, B, W)
            assert page.locator('rect.op[data-op="F7.0"]').count() == 1  # V: stage 2p-1 exists, on rank 0
            assert page.get_attribute('rect.op[data-op="F7.0"]', "data-rank") == "0"
            assert page.locator("polyline.mem").count() == 4
            assert page.locator("#memory text").count() == 2 * 4  # per rank: its label and its peak
            page.screenshot(path=str(tmp_path / "explorer.png"), full_page=True)
            assert errors == []
        finally:
            browser.close()


def test_torch_orders_are_variants_too() -> None:
    pytest.importorskip("torch.distributed.pipelining.schedules", reason="torch orders need torch")
    variants = build_variants(["torch:ZBVZeroBubble", "torch:Nope"], [(4, 8)], ["unit"])
    assert variants["torch:ZBVZeroBubble|4|8|unit"]["makespan"] == 25.5  # = v-zb's (half-cost V stages)
    assert "unknown torch schedule 'Nope'" in str(variants["torch:Nope|4|8|unit"]["error"])
