"""The headless-Chromium helper against a REAL local HTTP server: scripts run (the DOM holds what they wrote
after a fetch), and the screenshot is a PNG of the requested size showing what the page drew."""

from __future__ import annotations

import http.server
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.browser import dump_dom, png_size, screenshot
from tests.peers.http_server import serving

pytestmark = pytest.mark.browser

PAGE = b"""<!doctype html><html><body style="margin:0;background:#fff">
<canvas id="c" width="400" height="300"></canvas><div id="out">loading</div>
<script>
fetch('/data.json').then(r => r.json()).then(d => {
  const g = document.getElementById('c').getContext('2d');
  g.fillStyle = 'rgb(255,0,0)'; g.fillRect(0, 0, 200, 150);
  document.getElementById('out').textContent = 'hits=' + d.hits;
});
</script></body></html>"""


class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server API
        body, ctype = (PAGE, "text/html") if self.path == "/" else (b'{"hits": 42}', "application/json")
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    with serving(Handler) as url:
        yield url


def test_dump_dom_runs_scripts(server: str) -> None:
    dom = dump_dom(server)
    assert "hits=42" in dom and "loading" not in dom


def test_screenshot_shows_the_drawing(server: str, tmp_path: Path) -> None:
    import matplotlib.image as mpimg

    png = screenshot(server, tmp_path / "page.png", width=640, height=480)
    assert png_size(png) == (640, 480)
    img = mpimg.imread(png)  # rows x cols x RGB(A), floats 0..1
    r, g, b = img[50, 50, :3]
    assert r > 0.9 and g < 0.1 and b < 0.1, (r, g, b)  # inside the red rectangle
    r, g, b = img[250, 500, :3]
    assert min(r, g, b) > 0.9  # white background outside it
