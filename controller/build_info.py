"""Process-level metrics every scrape target carries: ``kvtier_build_info`` and the process/platform/GC
collectors of ``prometheus_client`` (``process_*``, ``python_info``, ``python_gc_*``).

The version comes from :data:`kvtier.__version__`, the one source that ``kvtier --version``, ``/openapi.json``
and the package metadata (``pyproject.toml`` reads it) all use, so the three cannot disagree.
"""

from __future__ import annotations

import platform

from prometheus_client import CollectorRegistry, Gauge, gc_collector, platform_collector, process_collector

from kvtier import __version__


def register_build_info(registry: CollectorRegistry) -> None:
    """``kvtier_build_info{version, python} 1`` plus the process, platform and GC collectors.

    Idempotent: a registry that already carries them (one shared by two components) is left as it is."""
    labels = {"version": __version__, "python": platform.python_version()}
    if registry.get_sample_value("kvtier_build_info", labels):
        return
    g = Gauge(
        "kvtier_build_info",
        "Always 1; the labels name the running kvtier build.",
        ["version", "python"],
        registry=registry,
    )
    g.labels(**labels).set(1)
    process_collector.ProcessCollector(registry=registry)
    platform_collector.PlatformCollector(registry=registry)
    gc_collector.GCCollector(registry=registry)
