"""The sidecar's collection runtime: :class:`CollectorSet` builds the collectors from :class:`Settings` and
runs each in its own task.

A peer that is down never stops the others: every collector polls on its own loop and ``poll()`` never raises.
It holds the collectors and feeds the :class:`KvIngestor` (block index); the prometheus registry and the HTTP
client are handed in by the composition root (:func:`kvtier.controller.root.build_sidecar`), which owns them.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

import httpx
import zmq.asyncio
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector as PromCollector

from kvtier.collectors.base import Clock, Collector
from kvtier.collectors.kv_ingest import EVENT_TYPES, KvIngestor
from kvtier.collectors.storage import StorageCollector
from kvtier.collectors.vllm_kv_subscriber import KvEventSubscriber
from kvtier.collectors.vllm_metrics import VllmMetricsCollector, VllmMetricsObservation
from kvtier.controller.settings import Settings
from kvtier.controller.tier_view import PerTierView, PerTierViewExporter, build_tier_view

log = logging.getLogger(__name__)


class PeerNotAvailable(RuntimeError):
    """A cache-layer collector module (``kvtier.collectors.lmcache_mp`` / ``.mooncake``) is not installed."""


def _engine_label(url: str) -> str:
    return urlsplit(url).netloc or url


class KvMetricsExporter(PromCollector):
    """Exports the ingestor's counters at scrape time (no per-event prometheus calls on the hot path)."""

    def __init__(self, collectors: CollectorSet) -> None:
        self.sc = collectors

    @staticmethod
    def _families() -> tuple[CounterMetricFamily | GaugeMetricFamily, ...]:
        """The exported families, empty (``describe`` names them; ``collect`` fills a fresh set)."""
        return (
            CounterMetricFamily("kvtier_kv_events", "KV-cache events received, by engine and type.",
                                labels=["engine", "type"]),
            CounterMetricFamily("kvtier_kv_block_events", "Block hashes in KV events, by engine and op.",
                                labels=["engine", "op"]),
            CounterMetricFamily("kvtier_kv_events_lost",
                                "KV-event batches lost (sequence gaps not replayed), by engine.",
                                labels=["engine"]),
            CounterMetricFamily("kvtier_kv_events_replayed", "KV-event batches recovered by replay.",
                                labels=["engine"]),
            GaugeMetricFamily("kvtier_blocks_tracked", "Blocks the sidecar believes resident, by tier.",
                              labels=["tier"]),
            GaugeMetricFamily("kvtier_index_blocks", "Blocks in the sidecar's index (resident or not)."),
            CounterMetricFamily("kvtier_index_reclaimed_blocks",
                                "Non-resident blocks the index forgot to stay within its bound."),
            CounterMetricFamily("kvtier_index_skipped_ops",
                                "Index updates skipped: the index was full of resident blocks."),
            CounterMetricFamily(
                "kvtier_kv_events_dropped",
                "KV-event work dropped to stay bounded: oversized events (hashes), stores past the residency "
                "bound (blocks), by engine and reason.",
                labels=["engine", "reason"],
            ),
            GaugeMetricFamily("kvtier_blocks_resident_distinct", "Distinct (tier, block) pairs believed "
                              "resident, all tiers (bounded by KVTIER_INDEX_MAX_BLOCKS)."),
            GaugeMetricFamily("kvtier_blocks_bound", "The configured per-block memory bound (blocks)."),
            GaugeMetricFamily("kvtier_process_resident_memory_bytes",
                              "Resident set size of the sidecar, bytes."),
        )  # fmt: skip

    def describe(self) -> Iterable[Metric]:
        """Names only: the registry then knows which families this exporter serves, so a reader of a few
        families (the status page's history, every second) can collect them without collecting everything."""
        return self._families()

    def collect(self) -> Iterable[Metric]:
        ing = self.sc.ingestor
        fams = self._families()
        ev, blk, lost, rep, tracked, size, reclaimed, skipped, dropped, distinct, bound, rss = fams
        for eng, c in sorted(ing.counts.items()):
            for t in EVENT_TYPES:
                ev.add_metric([eng, t], c.events.get(t, 0))
            for op, v in (("stored", c.blocks_stored), ("removed", c.blocks_removed),
                          ("reannounced", c.blocks_reannounced), ("removed_unknown", c.removed_unknown),
                          ("cleared", c.blocks_cleared), ("accessed", c.accesses_inferred)):  # fmt: skip
                blk.add_metric([eng, op], v)
            dropped.add_metric([eng, "oversized_event"], c.oversized_events)
            dropped.add_metric([eng, "residency_bound"], c.residency_skipped)
        for s in self.sc.subscribers:
            lost.add_metric([s.engine], s.lost)
            rep.add_metric([s.engine], s.replayed)
        for tier, n in ing.blocks_tracked().items():
            tracked.add_metric([tier], n)
        idx = ing.index
        size.add_metric([], len(idx))
        reclaimed.add_metric([], idx.reclaimed)
        skipped.add_metric([], ing.index_skipped)
        distinct.add_metric([], ing.resident_total())
        bound.add_metric([], ing.max_resident)
        rss.add_metric([], rss_bytes())
        yield from fams


def rss_bytes() -> float:
    """This process's resident set size in bytes (``/proc/self/statm``; 0 where /proc is absent)."""
    import os

    try:
        with open("/proc/self/statm") as f:
            return float(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError):
        return 0.0


class CollectorSet:
    """The collectors of the configured peers around one block index; :meth:`start` launches their loops,
    :meth:`stop` ends them. Built by :func:`kvtier.controller.root.build_sidecar` (nothing here does I/O
    before :meth:`start`)."""

    def __init__(
        self,
        settings: Settings,
        *,
        registry: CollectorRegistry,
        client: httpx.AsyncClient,
        clock: Clock,
        ingestor: KvIngestor,
        emulated_engine: bool = False,
    ) -> None:
        """``client`` and ``registry`` belong to the caller (closed/kept by it); ``emulated_engine``: the
        demo drives the index from a simulation, so no engine URL is needed for readiness."""
        self.settings = settings
        self.registry = registry
        self.client = client
        self.clock = clock
        self.ingestor = ingestor
        self.zctx = zmq.asyncio.Context()
        self.metrics_collectors: list[VllmMetricsCollector] = []
        self.subscribers: list[KvEventSubscriber] = []
        self.cache_collectors: list[Collector[Any, Any]] = []
        self.storage: StorageCollector | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self.started_at: float | None = None
        self.emulated_engine = emulated_engine
        kw: dict[str, Any] = {"client": self.client, "registry": self.registry, "clock": clock}
        for url in settings.collectors.engine_urls:
            eng = _engine_label(url)
            self.metrics_collectors.append(
                VllmMetricsCollector(
                    f"vllm_metrics:{eng}", url, timeout_s=settings.collectors.http_timeout_s, **kw
                )
            )
            self.subscribers.append(
                KvEventSubscriber(
                    f"vllm_kv_events:{eng}",
                    url,
                    ingestor=self.ingestor,
                    context=self.zctx,
                    engine=eng,
                    replay_timeout_s=settings.collectors.replay_timeout_s,
                    max_seq_gap=settings.collectors.max_seq_gap,
                    flush_interval_s=settings.collectors.kv_flush_interval_s,
                    timeout_s=settings.collectors.http_timeout_s,
                    **kw,
                )  # fmt: skip
            )
        for module, cls, flag, urls in (
            ("lmcache_mp", "LMCacheMPCollector", "--lmcache-url", settings.collectors.lmcache_urls),
            ("mooncake", "MooncakeCollector", "--mooncake-url", settings.collectors.mooncake_urls),
            ("lmcache_controller", "LMCacheControllerCollector", "--lmcache-controller-url",
             settings.collectors.lmcache_controller_urls),
        ):  # fmt: skip
            for url in urls:
                self.cache_collectors.append(self._cache_collector(module, cls, flag, url, kw))
        if settings.collectors.storage_enabled:
            self.storage = StorageCollector(
                registry=self.registry,
                clock=clock,
                root=settings.collectors.storage_root,
                tier_paths=settings.collectors.tier_paths,
                devices=settings.collectors.storage_devices,
            )
        self.registry.register(KvMetricsExporter(self))
        if (
            settings.collectors.engine_urls or settings.collectors.lmcache_urls
        ):  # the demo serves these families from its emulation
            self.registry.register(PerTierViewExporter(self.tier_view))

    def _cache_collector(
        self, module: str, cls: str, flag: str, url: str, kw: dict[str, Any]
    ) -> Collector[Any, Any]:
        """``kvtier.collectors.<module>.<cls>(name, url, client=, registry=, clock=, timeout_s=)``."""
        try:
            mod = importlib.import_module(f"kvtier.collectors.{module}")
            factory = getattr(mod, cls)
        except (ImportError, AttributeError) as exc:
            raise PeerNotAvailable(
                f"{flag} given but kvtier.collectors.{module}.{cls} is not available in this build ({exc})"
            ) from exc
        c: Collector[Any, Any] = factory(
            f"{module}:{_engine_label(url)}", url, timeout_s=self.settings.collectors.http_timeout_s, **kw
        )
        return c

    @property
    def collectors(self) -> list[Collector[Any, Any]]:
        out: list[Collector[Any, Any]] = [*self.metrics_collectors, *self.subscribers, *self.cache_collectors]
        if self.storage is not None:
            out.append(self.storage)
        return out

    # ---- lifecycle ----------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.started_at = self.clock()
        s = self.settings.collectors
        for mc, sub in zip(self.metrics_collectors, self.subscribers, strict=True):
            self._spawn(self._metrics_loop(mc, sub, s.scrape_interval_s), mc.name)
            self._spawn(self._loop(sub, s.discovery_interval_s), sub.name + ":discovery")
            self._spawn(sub.run(), sub.name + ":recv")
        for c in self.cache_collectors:
            self._spawn(self._loop(c, s.scrape_interval_s), c.name)
        if self.storage is not None:
            self._spawn(self._loop(self.storage, s.storage_interval_s), self.storage.name)

    def _spawn(self, coro: Any, name: str) -> None:
        self._tasks.append(asyncio.create_task(coro, name=name))

    async def _loop(self, c: Collector[Any, Any], interval: float) -> None:
        while True:
            await c.poll()
            await asyncio.sleep(interval)

    async def _metrics_loop(self, mc: VllmMetricsCollector, sub: KvEventSubscriber, interval: float) -> None:
        while True:
            obs = await mc.poll()
            if isinstance(obs, VllmMetricsObservation):
                sub.note_engine_start(obs.process_start_time)
            await asyncio.sleep(interval)

    async def poll_once(self) -> None:
        """Poll every collector once (metrics, discovery, cache layers, storage) -- for tests and warm-up."""
        for mc, sub in zip(self.metrics_collectors, self.subscribers, strict=True):
            obs = await mc.poll()
            if isinstance(obs, VllmMetricsObservation):
                sub.note_engine_start(obs.process_start_time)
            await sub.poll()
        for c in self.cache_collectors:
            await c.poll()
        if self.storage is not None:
            await self.storage.poll()

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        for c in self.collectors:
            with contextlib.suppress(Exception):
                await c.aclose()
        self.zctx.term()

    # ---- views --------------------------------------------------------------------------------------------
    def tier_view(self) -> PerTierView:
        """Per-tier hits, lookups and holdings from the latest vLLM and LMCache MP observations."""
        engines = [e for mc in self.metrics_collectors if mc.latest is not None for e in mc.latest.engines]
        layers = [c.latest for c in self.cache_collectors if c.kind == "lmcache_mp" and c.latest is not None]
        return build_tier_view(engines, layers)

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """(ready, detail) about the sidecar itself: an engine is configured, the collector loops run.

        A peer whose last poll failed does not make the sidecar unready: as a native sidecar its readiness
        gates the whole vLLM pod, which must not leave its Service on an LMCache hiccup. ``peers_up`` and
        ``down`` report the peers (the ``KvtierPeerDown`` alert watches them through /metrics)."""
        down = {c.name: c.health.last_error or "not polled yet" for c in self.collectors if not c.health.up}
        reasons = []
        if not self.settings.collectors.engine_urls and not self.emulated_engine:
            reasons.append("no engine configured (--engine-url or KVTIER_ENGINE_URLS)")
        if not self._tasks:
            reasons.append("collector loops not started")
        reasons += [f"collector loop {t.get_name()} ended" for t in self._tasks if t.done()]
        return not reasons, {
            "ready": not reasons,
            "reasons": reasons,
            "peers_up": not down,
            "down": down,
            "collectors": {c.name: c.health.up for c in self.collectors},
        }

    def status(self) -> dict[str, Any]:
        ing = self.ingestor
        ing.flush(wait=False)  # on the event loop: never wait for a running tick
        received = {e: {t: n for t, n in c.events.items()} for e, c in sorted(ing.counts.items())}
        engines = []
        for mc, sub in zip(self.metrics_collectors, self.subscribers, strict=True):
            latest = mc.latest
            samples = [_sample_dict(s) for s in latest.engines] if latest is not None else []
            first = samples[0] if samples else None
            c = ing.counts.get(sub.engine)
            engines.append(
                {
                    "url": mc.base_url,
                    "engine": sub.engine,
                    "up": mc.health.up,
                    "kv_events_up": sub.health.up,
                    "latest": first,
                    "prefix_cache_hit_ratio": first["prefix_cache_hit_ratio"] if first else None,
                    "samples": samples,  # one per (model, vLLM engine index / DP rank)
                    "process_start_time": latest.process_start_time if latest is not None else None,
                    "unknown_families": list(latest.unknown_families) if latest is not None else [],
                    "missing_families": list(latest.missing_families) if latest is not None else [],
                    "kv_events": sub.status(),
                    "blocks_held": {t.value: ing.held(sub.engine, t) for t in _tiers()},
                    "blocks": None
                    if c is None
                    else {
                        "stored": c.blocks_stored,
                        "removed": c.blocks_removed,
                        "reannounced": c.blocks_reannounced,
                        "removed_unknown": c.removed_unknown,
                        "cleared": c.blocks_cleared,
                        "accesses_inferred": c.accesses_inferred,
                    },  # fmt: skip
                }
            )
        return {
            "blocks_tracked": ing.blocks_tracked(),
            "index_blocks": len(ing.index),
            "index_max_blocks": ing.index.max_blocks,
            "index_reclaimed": ing.index.reclaimed,
            "index_skipped": ing.index_skipped,
            "index_flush_deferred": ing.flush_deferred,  # bulk applies put off while a tick read the index
            "kv_events_received": sum(sum(v.values()) for v in received.values()),
            "kv_events_received_by_engine": received,
            "kv_events_lost": sum(s.lost for s in self.subscribers),
            "kv_events_replayed": sum(s.replayed for s in self.subscribers),
            "engines": engines,
            "cache_layers": [c.status() for c in self.cache_collectors],
            "tier_view": self.tier_view().to_dict(),
            "storage": self.storage.status() if self.storage is not None else None,
            "collector_errors": {c.name: c.health.errors_by_kind for c in self.collectors},
        }


def _tiers() -> tuple[Any, ...]:
    from kvtier.policies.tiers import TIER_ORDER

    return TIER_ORDER


def _sample_dict(s: Any) -> dict[str, Any]:
    from dataclasses import asdict

    d: dict[str, Any] = asdict(s)
    return d
