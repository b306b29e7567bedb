"""Sidecar logging: per-request client logs stay out of INFO; JSON lines carry extra fields."""

from __future__ import annotations

import io
import json
import logging
from http.server import BaseHTTPRequestHandler

import httpx

from kvtier.controller.logs import configure_logging
from tests.peers.http_server import serving


class _Ok(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args: object) -> None:  # keep the server quiet
        pass


def _capture(level: str, *, json_lines: bool = False) -> io.StringIO:
    configure_logging(level, json_lines=json_lines)
    buf = io.StringIO()
    logging.getLogger().handlers[0].setStream(buf)  # type: ignore[attr-defined]
    return buf


def test_peer_requests_are_not_logged_at_info_but_are_at_debug() -> None:
    """A real HTTP request through httpx against a loopback server."""
    try:
        with serving(_Ok) as url:
            buf = _capture("INFO")
            httpx.get(url, timeout=5).raise_for_status()
            logging.getLogger("kvtier.test").info("own line")
            assert "own line" in buf.getvalue() and "HTTP Request" not in buf.getvalue()
            buf = _capture("DEBUG")
            httpx.get(url, timeout=5).raise_for_status()
            assert "HTTP Request" in buf.getvalue()
    finally:
        configure_logging("WARNING")


def test_json_lines_carry_extra_fields() -> None:
    try:
        buf = _capture("INFO", json_lines=True)
        logging.getLogger("kvtier.test").info("tick done", extra={"tick": 7, "elapsed_ms": 1.5})
        rec = json.loads(buf.getvalue().strip().splitlines()[-1])
        assert rec["msg"] == "tick done" and rec["tick"] == 7 and rec["elapsed_ms"] == 1.5
    finally:
        configure_logging("WARNING")
