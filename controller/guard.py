"""HTTP front door (pure ASGI middleware): Host allow-list, bearer auth, body limits before the body is read.

Why a middleware and not FastAPI dependencies: a dependency runs after the request body has been received and
parsed, so an 80 MB body was parsed (seconds of event-loop time, hundreds of MB of RSS) before a 401. Here
every check that needs only the headers runs first:

* ``Host`` must be in the allow-list (when one is given): defeats DNS rebinding against a loopback listener.
* Mutations (POST/PUT/PATCH/DELETE) with an ``Origin`` header from a host outside the allow-list are refused
  (a browser page on another site cannot drive the API, token or not).
* Mutations need ``Authorization: Bearer <token>`` when a token is configured: 401 missing, 403 wrong
  (constant-time compare).
* A mutation carrying a body must be ``Content-Type: application/json`` (415): a cross-origin "simple"
  request (text/plain, form) cannot reach a handler.
* ``Content-Length`` above ``max_body_bytes`` is 413 without reading a byte; a chunked body is read up to the
  limit and refused as soon as it passes it.
* At most ``max_inflight`` requests are handled at once (503 with ``Retry-After`` beyond); ``/healthz`` is
  exempt and answered here, on the event loop, so liveness stays cheap under load.

Rejections are counted in ``kvtier_api_rejected_requests_total{reason}`` when a registry is given.
"""

from __future__ import annotations

import hmac
import json
import logging
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "[::1]"})


def is_loopback(host: str) -> bool:
    """True for a listen host that only local processes can reach."""
    h = host.strip("[]").lower()
    return h in ("localhost", "::1") or h.startswith("127.")


def host_only(value: str) -> str:
    """``Host``/``Origin`` value -> lowercase host without port (``[::1]:8787`` -> ``[::1]``)."""
    v = value.strip().lower()
    if "://" in v:
        v = v.split("://", 1)[1]
    v = v.split("/", 1)[0]
    if v.startswith("["):
        return v.split("]", 1)[0] + "]"
    return v.rsplit(":", 1)[0] if v.count(":") == 1 else v


def allowed_hosts_for(listen_host: str, extra: Iterable[str] = ()) -> frozenset[str] | None:
    """The Host allow-list for a listener: loopback names (+ ``extra``) for a loopback or named listener;
    None (any Host) for a wildcard bind, which is only allowed with a token (see settings)."""
    extra = [host_only(h) for h in extra if h.strip()]
    if "*" in extra:
        return None
    h = listen_host.strip("[]").lower()
    if h in ("0.0.0.0", "::", "") and not extra:
        return None
    base = set(LOOPBACK_HOSTS) if is_loopback(h) or h in ("0.0.0.0", "::", "") else {host_only(h)}
    if ":" in h and not h.startswith("["):
        base.add(f"[{h}]")
    return frozenset(base | set(extra))


class RequestGuard:
    """ASGI middleware; see the module docstring. ``token`` None = mutations need no token (loopback only:
    the settings refuse a non-loopback listener without one)."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        token: str | None,
        allowed_hosts: frozenset[str] | None = None,
        max_body_bytes: int = 1 << 20,
        max_inflight: int = 64,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.app = app
        self.token = token.encode() if token else None
        self.allowed_hosts = allowed_hosts
        self.max_body_bytes = max_body_bytes
        self.max_inflight = max_inflight
        self.inflight = 0
        self.rejected: dict[str, int] = {}
        self._counter = (
            Counter(
                "kvtier_api_rejected_requests",
                "HTTP requests refused by the front door before reaching a handler, by reason.",
                ["reason"],
                registry=registry,
            )
            if registry is not None
            else None
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.lower(): v for k, v in scope.get("headers") or ()}
        path = scope.get("path", "")
        method = scope.get("method", "GET").upper()
        if self.allowed_hosts is not None:
            host = host_only(headers.get(b"host", b"").decode("latin-1"))
            if host not in self.allowed_hosts:
                await self._reject(send, 421, "host", "Host header not allowed for this listener")
                return
        if path == "/healthz" and method in ("GET", "HEAD"):
            await _json(send, 200, {"status": "ok"})
            return
        length = headers.get(b"content-length")
        try:
            n = int(length) if length is not None else None
        except ValueError:
            await self._reject(send, 400, "bad_length", "invalid Content-Length")
            return
        if method in MUTATING:
            origin = headers.get(b"origin")
            if origin is not None and origin != b"null" and self.allowed_hosts is not None:
                if host_only(origin.decode("latin-1")) not in self.allowed_hosts:
                    await self._reject(send, 403, "origin", "cross-origin mutation refused")
                    return
            elif origin == b"null":
                await self._reject(send, 403, "origin", "cross-origin mutation refused")
                return
            if self.token is not None:
                auth = headers.get(b"authorization")
                if not auth:
                    why = "missing Authorization: Bearer <token> header"
                    await self._reject(send, 401, "unauthenticated", why, bearer=True)
                    return
                scheme, _, tok = auth.partition(b" ")
                if scheme.lower() != b"bearer" or not tok.strip():
                    why = "Authorization header must be 'Bearer <token>'"
                    await self._reject(send, 401, "unauthenticated", why, bearer=True)
                    return
                if not hmac.compare_digest(tok.strip(), self.token):
                    await self._reject(send, 403, "forbidden", "invalid API token")
                    return
            if n is not None and n > self.max_body_bytes:
                await self._reject(send, 413, "too_large", f"body larger than {self.max_body_bytes} bytes")
                return
            has_body = (n or 0) > 0 or b"chunked" in headers.get(b"transfer-encoding", b"").lower()
            if has_body:
                ctype = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
                if ctype != b"application/json":
                    await self._reject(
                        send, 415, "content_type", "mutations take Content-Type: application/json"
                    )
                    return
        elif n is not None and n > self.max_body_bytes:
            await self._reject(send, 413, "too_large", f"body larger than {self.max_body_bytes} bytes")
            return
        if self.inflight >= self.max_inflight:
            await self._reject(send, 503, "busy", "too many concurrent requests", retry=True)
            return
        self.inflight += 1
        try:
            if n is None and b"chunked" in headers.get(b"transfer-encoding", b"").lower():
                body = await self._read_bounded(receive)
                if body is None:
                    await self._reject(
                        send, 413, "too_large", f"body larger than {self.max_body_bytes} bytes"
                    )
                    return
                receive = _replay(body, receive)
            await self.app(scope, receive, send)
        finally:
            self.inflight -= 1

    async def _read_bounded(self, receive: Receive) -> bytes | None:
        parts: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                break
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            parts.append(chunk)
            if not msg.get("more_body"):
                break
        return b"".join(parts)

    async def _reject(
        self, send: Send, status: int, reason: str, detail: str, *, bearer: bool = False, retry: bool = False
    ) -> None:
        self.rejected[reason] = self.rejected.get(reason, 0) + 1
        if self._counter is not None:
            self._counter.labels(reason).inc()
        extra: list[tuple[bytes, bytes]] = []
        if bearer:
            extra.append((b"www-authenticate", b"Bearer"))
        if retry:
            extra.append((b"retry-after", b"1"))
        if status in (413, 400):
            extra.append((b"connection", b"close"))  # the unread body must not be parsed as a next request
        await _json(send, status, {"detail": detail}, extra)


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _json(send: Send, status: int, doc: Any, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps(doc).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers + (extra or [])})
    await send({"type": "http.response.body", "body": body})
