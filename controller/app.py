"""The sidecar's HTTP API (FastAPI app factory): /metrics, /v1/status, /healthz, /readyz.

``create_app(sidecar)`` returns the app; other subsystems add their routers with ``app.include_router`` and
reach shared state through ``request.app.state.sidecar`` (a :class:`~kvtier.controller.sidecar.Sidecar`).
With ``manage_lifecycle=True`` the app's lifespan starts and stops the sidecar's collector loops.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvtier.controller.sidecar import Sidecar


def create_app(sidecar: Sidecar, *, manage_lifecycle: bool = True, title: str = "kvtier") -> FastAPI:
    """Build the API around ``sidecar``."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_lifecycle:
            await sidecar.start()
        try:
            yield
        finally:
            if manage_lifecycle:
                await sidecar.stop()

    app = FastAPI(title=title, lifespan=lifespan)
    app.state.sidecar = sidecar

    @app.get("/metrics")
    def metrics() -> Response:
        """kvtier's own Prometheus registry (text exposition)."""
        return Response(generate_latest(sidecar.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/status")
    def status(request: Request) -> dict[str, Any]:
        """Blocks per tier, KV-event counts, engines with their latest sample, cache layers, storage.
        KV-event stream positions (``next_seq``, ``held_seq``) only with the API token: they would let a
        local process forge the next batch."""
        out: dict[str, Any] = request.app.state.sidecar.status()
        if not _authorized(request):
            for eng in out.get("engines") or ():
                for src in (eng.get("kv_events") or {}).get("sources") or ():
                    src.pop("next_seq", None)
                    src.pop("held_seq", None)
        return out

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        """The sidecar process is alive (peers may be down; see /readyz)."""
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> JSONResponse:
        """200 when every configured peer answered its last poll, else 503 listing what is down."""
        ready, detail = sidecar.readiness()
        return JSONResponse(detail, status_code=200 if ready else 503)

    return app


def _authorized(request: Request) -> bool:
    """The request carries the API token (always False when no token is configured: nothing to prove)."""
    import hmac

    token = getattr(request.app.state, "guard_token", None)
    if not token:
        return False
    scheme, _, tok = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(tok.strip().encode(), token.encode())
