"""The one FastAPI app factory: :func:`create_app` serves a :class:`~kvtier.controller.sidecar.Sidecar`
(built by :func:`kvtier.controller.root.build_sidecar`) -- /metrics, /v1/status, /healthz, /readyz and the
policy API (/v1/policy, /v1/pins, /v1/decisions, ...; OpenAPI at /docs).

``kvtier serve``, ``kvtier demo`` and the tests all serve this app; extra routes (the status page, the demo's
``/v1/demo``) are added to it, and handlers reach shared state through ``request.app.state.sidecar``.
With ``manage_lifecycle=True`` the app's lifespan starts and stops the sidecar.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from fastapi_offline import FastAPIOffline
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field

from kvtier import __version__
from kvtier.controller.sidecar import Sidecar
from kvtier.controller.tracing import instrument_app


class Health(BaseModel):
    status: str = Field(description='"ok" while the process serves requests')


class Readiness(BaseModel):
    ready: bool = Field(description="the sidecar itself is ready (an engine configured, loops running)")
    reasons: list[str] = Field(description="why it is not ready; empty when ready")
    peers_up: bool = Field(description="every configured peer answered its last poll (does not gate ready)")
    down: dict[str, str] = Field(description="collector -> last error, for the peers that are down")
    collectors: dict[str, bool] = Field(description="collector -> up")


def operation_id(route: APIRoute) -> str:
    """The handler's name (``get_policy``, ``add_pin``) instead of FastAPI's path-derived id."""
    return route.name


def declare_bearer_auth(app: FastAPI) -> None:
    """OpenAPI: the HTTP bearer scheme (``KVTIER_API_TOKEN``) on every mutating operation, so generated
    clients and /docs' "Authorize" send it."""
    base = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        spec = base()
        schemes = spec.setdefault("components", {}).setdefault("securitySchemes", {})
        schemes.setdefault(
            "bearerAuth",
            {"type": "http", "scheme": "bearer", "description": "KVTIER_API_TOKEN; mutations need it"},
        )
        for ops in spec.get("paths", {}).values():
            for method, op in ops.items():
                if method in ("post", "put", "patch", "delete"):
                    op.setdefault("security", [{"bearerAuth": []}])
        return spec

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(sidecar: Sidecar, *, manage_lifecycle: bool = True, title: str = "kvtier") -> FastAPI:
    """The API around ``sidecar``; ``manage_lifecycle``: the lifespan runs :meth:`Sidecar.start` and
    :meth:`Sidecar.stop` (False when the caller drives the sidecar, e.g. a test's TestClient without it)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_lifecycle:
            await sidecar.start()
        try:
            yield
        finally:
            if manage_lifecycle:
                await sidecar.stop()

    app = FastAPIOffline(
        title=title, version=__version__, lifespan=lifespan, generate_unique_id_function=operation_id
    )
    declare_bearer_auth(app)
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

    @app.get("/healthz", response_model=Health)
    async def healthz() -> dict[str, str]:
        """The sidecar process is alive (peers may be down; see /readyz)."""
        return {"status": "ok"}

    @app.get("/readyz", response_model=Readiness, responses={503: {"model": Readiness}})
    def readyz() -> JSONResponse:
        """200 when the sidecar itself is ready (an engine configured, collector loops running), else 503
        with the reasons; ``peers_up``/``down`` report the peers without gating readiness."""
        ready, detail = sidecar.readiness()
        return JSONResponse(detail, status_code=200 if ready else 503)

    sidecar.plane.mount(app)
    instrument_app(app, sidecar.tracer_provider)
    return app


def _authorized(request: Request) -> bool:
    """The request carries the API token, or none is configured (loopback only, where every local process
    may already mutate: hiding stream positions would protect nothing)."""
    import hmac

    token = getattr(request.app.state, "guard_token", None)
    if not token:
        return True
    scheme, _, tok = request.headers.get("authorization", "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(tok.strip().encode(), token.encode())
