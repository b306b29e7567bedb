"""Headless Chromium (Debian ``chromium``) against a REAL ``kvtier demo`` subprocess: the status page at ``/``
loads, its charts hold data, the data changes over time, and a screenshot is written (path printed).

Run: ``pytest tests/e2e/test_status_page.py -s``; then open ``out/status_page.png``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.e2e.browser import dump_dom, png_size, screenshot
from tests.e2e.demo_proc import running_demo
from tests.peers.procs import wait_for

pytestmark = pytest.mark.browser


def _points(dom: str, chart: str) -> int:
    m = re.search(rf'<svg id="{chart}" data-points="(\d+)"', dom)
    assert m, f"chart {chart} missing from the page"
    return int(m.group(1))


def _lines(dom: str, chart: str) -> list[str]:
    m = re.search(rf'<svg id="{chart}".*?</svg>', dom, re.S)
    assert m
    return re.findall(r'points="([^"]*)"', m.group(0))


def test_status_page_charts_fill_and_change(tmp_path: Path) -> None:
    with running_demo("--speed", "30", "--duration", "300") as demo:

        def used_samples(n: int) -> list[dict[str, object]] | None:
            s = demo.get("/v1/history").json()["samples"]
            ok = [x for x in s if x["tiers"]["gpu"].get("used_bytes", 0) > 0]
            return s if len(ok) >= n else None

        first = wait_for(lambda: used_samples(3), 90, "history with tier usage")
        page = demo.get("/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert "<script" in page.text and "http://" not in page.text.replace(
            "http://www.w3.org", ""
        )  # no CDN

        dom1 = dump_dom(demo.url + "/", virtual_time_ms=4000)
        p1 = {c: _points(dom1, c) for c in ("c-usage", "c-hit", "c-moved")}
        print(f"\nfirst load: points per chart {p1}")
        for c, n in p1.items():
            assert n > 0, f"chart {c} is empty on the status page"
        assert re.search(r"<td>gpu</td><td>[\d.]+ (MiB|GiB|TiB)</td>", dom1), "tier table has no gpu usage"
        # wait for more history, then the page must draw more (and different) data
        wait_for(lambda: used_samples(len(first) + 3), 90, "more history samples")
        dom2 = dump_dom(demo.url + "/", virtual_time_ms=4000)
        p2 = {c: _points(dom2, c) for c in ("c-usage", "c-hit", "c-moved")}
        print(f"later load: points per chart {p2}")
        assert p2["c-usage"] > p1["c-usage"]
        assert _lines(dom2, "c-usage") != _lines(dom1, "c-usage")
        assert (
            "<td>shadow</td>" in dom2
            or "<td>planned</td>" in dom2
            or "<td>demote</td>" in dom2
            or re.search(r"<td>(promote|demote|evict|admit|prefetch)</td>", dom2)
        ), "no recent decisions listed"

        wait_for(lambda: demo.get("/v1/model").json().get("auc") is not None, 120, "a trained predictor")
        png = tmp_path / "status_page.png"
        shot = screenshot(demo.url + "/", png, width=1400, height=1000, virtual_time_ms=5000)
        print(f"status page screenshot: {shot}")
        assert png_size(shot) == (1400, 1000)
        assert shot.stat().st_size > 20_000  # charts and tables drawn, not a blank page
