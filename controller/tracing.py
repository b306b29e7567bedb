"""OpenTelemetry: the tracer provider, HTTP instrumentation, trace ids on log records.

* Export: OTLP/HTTP when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (extra ``otlp``); ``OTEL_SERVICE_NAME`` and
  ``OTEL_RESOURCE_ATTRIBUTES`` name the service (default ``kvtier``).
* httpx (``opentelemetry-instrumentation-httpx``): every peer call made inside a span -- an actuation's
  call to LMCache, Mooncake or vLLM -- becomes a client span under it and carries ``traceparent`` to the
  peer. Root client spans (the collectors' scrapes every second or two, outside any span) are not sampled:
  they would bury the ticks and actuations.
* FastAPI (``opentelemetry-instrumentation-fastapi``): a server span per API request, except the scrape and
  probe endpoints.

The loop takes a ``Tracer`` by injection; tests pass one built on the SDK's ``InMemorySpanExporter``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, Decision, ParentBased, Sampler, SamplingResult
from opentelemetry.trace import Link, SpanKind, Tracer
from opentelemetry.util.types import Attributes

log = logging.getLogger(__name__)

UNTRACED_PATHS = "/metrics,/healthz,/readyz"  # scrapes and probes: no server spans


class NoRootClientSpans(Sampler):
    """Root sampler: drop a CLIENT span that has no parent (a scrape), keep every other root span."""

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: Any = None,
    ) -> SamplingResult:
        if kind is SpanKind.CLIENT:
            return SamplingResult(Decision.DROP)
        return ALWAYS_ON.should_sample(parent_context, trace_id, name, kind, attributes, links, trace_state)

    def get_description(self) -> str:
        return "NoRootClientSpans"


def make_tracer_provider(
    service_name: str = "kvtier", exporter: SpanExporter | None = None, *, simple: bool = False
) -> TracerProvider:
    """A provider exporting to ``exporter`` (sync when ``simple``), else to OTLP when configured."""
    name = os.environ.get("OTEL_SERVICE_NAME") or service_name
    provider = TracerProvider(
        resource=Resource.create({SERVICE_NAME: name}), sampler=ParentBased(root=NoRootClientSpans())
    )
    if exporter is None and os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        except ImportError:
            log.warning("OTEL_EXPORTER_OTLP_ENDPOINT is set but the 'otlp' extra is not installed; no export")
        else:
            exporter = OTLPSpanExporter()
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter) if simple else BatchSpanProcessor(exporter))
    return provider


def make_tracer(provider: TracerProvider) -> Tracer:
    return provider.get_tracer("kvtier.controller")


def instrument_http(provider: TracerProvider) -> None:
    """Client spans + ``traceparent`` for every httpx client of the process, exported through ``provider``.

    Process-wide (httpx's transports are patched); a later call rebinds to its provider, so the last
    sidecar built in a process (tests build several) owns the spans."""
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor

    inst = HTTPXClientInstrumentor()
    if inst.is_instrumented_by_opentelemetry:
        inst.uninstrument()
    inst.instrument(tracer_provider=provider)


def uninstrument_http() -> None:
    from opentelemetry.instrumentation.httpx import HTTPXClientInstrumentor

    inst = HTTPXClientInstrumentor()
    if inst.is_instrumented_by_opentelemetry:
        inst.uninstrument()


def instrument_app(app: Any, provider: TracerProvider) -> None:
    """A server span per API request (W3C ``traceparent`` honoured), scrapes and probes excluded."""
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor

    FastAPIInstrumentor.instrument_app(app, tracer_provider=provider, excluded_urls=UNTRACED_PATHS)


def current_trace_ids() -> tuple[str, str] | None:
    """(trace_id, span_id) of the current span as hex, or None outside a sampled span."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")
