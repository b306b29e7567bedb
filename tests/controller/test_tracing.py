"""Tracing: an actuation's span carries the HTTP client span of the call it made, and the peer receives
the same trace in ``traceparent``; the API gets server spans (not for scrapes and probes); OTEL_SERVICE_NAME
names the service; log records made inside a span carry its trace id.

The peer is a real HTTP server on 127.0.0.1 answering vLLM's ``POST /v1/completions`` shape (the real vLLM
variant of this flow is tests/controller/test_vllm_warmup_e2e.py); spans go to the SDK's in-memory exporter.
"""

from __future__ import annotations

import io
import json
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from kvtier.controller.actuators.vllm_warmup import VllmWarmupActuator, WarmupBudget
from kvtier.controller.app import create_app
from kvtier.controller.logs import configure_logging
from kvtier.controller.root import build_sidecar
from kvtier.controller.tracing import (
    instrument_http,
    make_tracer,
    make_tracer_provider,
    uninstrument_http,
)
from tests.controller import built
from tests.peers.http_server import serving

TOKEN = "trace-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class Completions(BaseHTTPRequestHandler):
    """``POST /v1/completions`` -> a one-token completion; keeps each request's ``traceparent``."""

    seen: list[str | None] = []
    lock = threading.Lock()

    def do_POST(self) -> None:  # noqa: N802 - http.server API
        self.rfile.read(int(self.headers.get("Content-Length", "0")))
        with self.lock:
            self.seen.append(self.headers.get("traceparent"))
        body = json.dumps({"choices": [{"text": "x"}], "usage": {"prompt_tokens": 64}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a: object) -> None:
        pass


@pytest.fixture()
def traced(tmp_path: Path) -> Iterator[dict[str, Any]]:
    Completions.seen = []
    exporter = InMemorySpanExporter()
    provider = make_tracer_provider(exporter=exporter, simple=True)
    instrument_http(provider)
    with serving(Completions) as url:
        act = VllmWarmupActuator(url.rstrip("/"), "tiny", budget=WarmupBudget(1e6, 100))
        sc = build_sidecar(built.settings(tmp_path, api_token=TOKEN, allow_active=True), actuators=[act],
                           tracer_provider=provider)  # fmt: skip
        app = create_app(sc, manage_lifecycle=False)
        try:
            yield {"plane": sc.plane, "app": app, "exporter": exporter}
        finally:
            uninstrument_http()
            act.close()
            sc.plane.store.close()


def test_actuation_span_carries_the_http_client_span_and_traceparent(traced: dict[str, Any]) -> None:
    plane, exporter = traced["plane"], traced["exporter"]
    with TestClient(traced["app"], base_url="http://127.0.0.1") as c:
        assert c.patch("/v1/policy", json={"mode": "active"}, headers=AUTH).status_code == 200
        bs = plane.loop.policy.block_size_tokens
        r = c.post("/v1/pins", json={"token_ids": list(range(1, 2 * bs + 1)), "tier": "gpu"}, headers=AUTH)
        assert r.status_code == 201, r.text
        exporter.clear()
        rep = plane.loop.tick()
        assert rep.outcomes["applied"] >= 1, rep.to_dict()
        spans = exporter.get_finished_spans()
        (act,) = [s for s in spans if s.name == "kvtier.actuate"]
        assert act.attributes["kvtier.layer"] == "vllm-warmup"
        clients = [s for s in spans if s.kind is SpanKind.CLIENT]
        assert clients, [s.name for s in spans]
        for s in clients:
            assert s.parent is not None and s.parent.span_id == act.context.span_id  # child of the actuation
            assert s.context.trace_id == act.context.trace_id
            assert s.attributes.get("http.request.method", s.attributes.get("http.method")) == "POST"
        trace_hex = format(act.context.trace_id, "032x")
        assert Completions.seen and all(tp and tp.split("-")[1] == trace_hex for tp in Completions.seen)

        # the API request got a server span; the scrape and probe endpoints did not
        exporter.clear()
        assert c.get("/v1/policy").status_code == 200
        assert c.get("/metrics/").status_code == 200
        servers = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]
        assert [s.attributes.get("http.route") for s in servers] == ["/v1/policy"]


def test_scrapes_outside_a_span_are_not_traced(traced: dict[str, Any]) -> None:
    import httpx

    with serving(Completions) as url:
        httpx.post(url + "v1/completions", json={}, timeout=5)  # a collector-style call: no parent span
    assert not traced["exporter"].get_finished_spans()
    tp = Completions.seen[-1]  # at most an unsampled context (flags without the sampled bit)
    assert tp is None or int(tp.split("-")[3], 16) & 1 == 0, tp


def test_otel_service_name_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    assert make_tracer_provider().resource.attributes["service.name"] == "kvtier"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "kvtier-pod-a")
    assert make_tracer_provider().resource.attributes["service.name"] == "kvtier-pod-a"


def test_log_records_inside_a_span_carry_its_trace_id() -> None:
    configure_logging("INFO", json_lines=True)
    buf = io.StringIO()
    logging.getLogger().handlers[0].setStream(buf)  # type: ignore[attr-defined]
    provider = make_tracer_provider(exporter=InMemorySpanExporter(), simple=True)
    log = logging.getLogger("kvtier.test")
    with make_tracer(provider).start_as_current_span("kvtier.tick") as span:
        log.info("inside")
    log.info("outside")
    inside, outside = (json.loads(x) for x in buf.getvalue().splitlines())
    assert inside["trace_id"] == format(span.get_span_context().trace_id, "032x")
    assert inside["span_id"] == format(span.get_span_context().span_id, "016x")
    assert "trace_id" not in outside
