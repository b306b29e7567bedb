"""Headless Chromium (Debian ``chromium``) for page tests: a screenshot (PNG) and the DOM after scripts ran.

    png = screenshot("http://127.0.0.1:8787/", Path("out/status.png"))
    html = dump_dom("http://127.0.0.1:8787/")

``virtual_time_ms`` lets the page's scripts (fetches, timers, chart drawing) run that long in Chromium's
virtual time before the capture. A fresh profile directory is used and deleted per call; no network beyond
the URL is contacted (background networking, component updates, sync and QUIC are off).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path


class ChromiumMissing(RuntimeError):
    """Debian's chromium is not installed."""


def chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    raise ChromiumMissing("chromium not on PATH: run scripts/setup-peers.sh (apt-get install chromium)")


def run(args: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Headless Chromium with ``args`` on a throwaway profile, at most ``timeout_s`` seconds (text output)."""
    profile = tempfile.mkdtemp(prefix="kvtier-chromium-")
    cmd = [
        chromium(),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        f"--user-data-dir={profile}",
        *args,
    ]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    finally:
        shutil.rmtree(profile, ignore_errors=True)
    if r.returncode != 0:
        raise RuntimeError(f"chromium failed ({r.returncode}): {r.stderr[-2000:]}")
    return r


def screenshot(
    url: str,
    out: Path,
    width: int = 1280,
    height: int = 900,
    virtual_time_ms: int = 3000,
    timeout_s: float = 120.0,
) -> Path:
    """Load ``url`` and write a ``width`` x ``height`` PNG to ``out``; returns ``out``."""
    out = Path(out).resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    run(
        [
            f"--window-size={width},{height}",
            f"--virtual-time-budget={virtual_time_ms}",
            f"--screenshot={out}",
            url,
        ],
        timeout_s,
    )
    if not out.exists() or out.stat().st_size == 0:
        raise RuntimeError(f"chromium wrote no screenshot to {out}")
    return out


def dump_dom(url: str, virtual_time_ms: int = 3000, timeout_s: float = 120.0) -> str:
    """The serialized DOM of ``url`` after its scripts ran for ``virtual_time_ms``."""
    return run([f"--virtual-time-budget={virtual_time_ms}", "--dump-dom", url], timeout_s).stdout


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    head = Path(path).read_bytes()[:24]
    if head[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path} is not a PNG")
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")
