"""OpenTelemetry tracer setup: OTLP/HTTP export when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (extra ``otlp``).

The loop takes a ``Tracer`` by injection; tests pass one built on the SDK's ``InMemorySpanExporter``.
"""

from __future__ import annotations

import logging
import os

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import Tracer

log = logging.getLogger(__name__)


def make_tracer_provider(
    service_name: str = "kvtier", exporter: SpanExporter | None = None, *, simple: bool = False
) -> TracerProvider:
    """A provider exporting to ``exporter`` (sync when ``simple``), else to OTLP when configured."""
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
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
