"""GET for scrapers: one immediate retry when a pooled keep-alive connection turns out to be closed by the
peer (``RemoteProtocolError`` / ``ReadError`` before any response) -- GET is idempotent."""

from __future__ import annotations

import httpx


async def get(client: httpx.AsyncClient, url: str, timeout_s: float) -> httpx.Response:
    """GET ``url``; raises ``httpx.HTTPStatusError`` on status >= 400."""
    try:
        r = await client.get(url, timeout=timeout_s)
    except (httpx.RemoteProtocolError, httpx.ReadError):
        r = await client.get(url, timeout=timeout_s)  # stale pooled connection: retry once on a new one
    r.raise_for_status()
    return r
