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
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvtier import __version__
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

    app = FastAPIOffline(title=title, version=__version__, lifespan=lifespan)
    app.state.sidecar = sidecar

    @app.get("/metrics")
    def metrics() -> Response:
        """kvtier's own Prometheus registry (text exposition)."""
        return Response(generate_latest(sidecar.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/status")
    def status(request: Request) -> dict[str, Any]:
        """Blocks per tier, KV-event counts, engines with their latest sample, cache layers, storage."""
        out: dict[str, Any] = request.app.state.sidecar.status()
        return out

    @app.get("/healthz")
    def healthz() -> dict[str, str]:
        """The sidecar process is alive (peers may be down; see /readyz)."""
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz() -> JSONResponse:
        """200 when the sidecar itself is ready (an engine configured, collector loops running), else 503
        with the reasons; ``peers_up``/``down`` report the peers without gating readiness."""
        ready, detail = sidecar.readiness()
        return JSONResponse(detail, status_code=200 if ready else 503)

    return app
