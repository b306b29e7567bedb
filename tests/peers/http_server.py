"""A real HTTP server on 127.0.0.1 (ephemeral port) in a daemon thread, for tests of HTTP clients."""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    """Serve ``handler`` until the block exits; yields the base URL (``http://127.0.0.1:PORT/``)."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}/"
    finally:
        srv.shutdown()
        srv.server_close()


class MetricsText:
    """The exposition text a :func:`metrics_text_handler` serves; tests set :attr:`text` between scrapes."""

    text: str = ""


def metrics_text_handler(state: MetricsText) -> type[http.server.BaseHTTPRequestHandler]:
    """A handler answering every GET with ``state.text`` as Prometheus text (read once per request, so a
    scrape sees one text or the next, never a mix; undecodable characters pass through as surrogates)."""

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server API
            body = state.text.encode("utf-8", "surrogateescape")
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a: object) -> None:
            pass

    return H
