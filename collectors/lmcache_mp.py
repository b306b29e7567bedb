"""LMCache MP server collector: ``GET /metrics`` (``lmcache_mp_*``) + ``GET /status`` on its HTTP port.

Tier names are kvtier's: L1 (DRAM) -> ``cpu``, L2 (``fs`` etc.) -> ``disk``. Counters are summed over their
label sets (model_name, cache_salt, l1_tag, l2_name). Units: tokens, chunks, bytes, seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtier.policies.tiers import Tier

from .base import HttpPeerCollector, Observation
from .promtext import ParsedText, parse_families

PREFIX = "lmcache_mp_"

# sample name -> LMCacheMPSample counter field
_COUNTERS = {
    "lookup_requested_tokens_total": "lookup_requested_tokens",
    "lookup_hit_tokens_total": "lookup_hit_tokens",
    "lookups_requests_total": "lookup_requests",
    "l1_write_chunks_total": "l1_write_chunks",
    "l1_read_chunks_total": "l1_read_chunks",
    "l1_evicted_chunks_total": "l1_evicted_chunks",
    "l1_read_failure_chunks_total": "l1_read_failure_chunks",
    "l2_store_submitted_objects_chunks_total": "l2_store_submitted_chunks",
    "l2_store_completed_objects_chunks_total": "l2_store_completed_chunks",
    "l2_prefetch_lookup_requests_total": "prefetch_lookup_requests",
    "l2_prefetch_load_submitted_objects_chunks_total": "prefetch_load_submitted_chunks",
    "l2_prefetch_load_completed_chunks_total": "prefetch_load_completed_chunks",
    "event_bus_dropped_events_total": "event_bus_dropped_events",
}
_REUSE_GAP = "l1_chunk_reuse_gap_seconds"
# the sample names read; the parser skips the rest (a live scrape grows to ~250 lines, most of them
# histograms and process families this collector does not read, and it is parsed every scrape_interval_s
# on the engine's host)
READ_SAMPLES = frozenset(
    PREFIX + n
    for n in (
        *_COUNTERS,
        "l1_memory_usage_bytes", "l2_usage_bytes", "l1_usage_ratio", "active_prefetch_jobs",
        "lookup_hit_l1_tokens_total", "lookup_hit_l2_tokens_total",
        "lookup_hit_l1_keys_total", "lookup_hit_l2_keys_total",
        *(_REUSE_GAP + suffix for suffix in ("_bucket", "_sum", "_count")),
    )
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class HistogramSummary:
    """Cumulative histogram: ``buckets`` = [(upper bound, cumulative count)], sum in the metric's unit."""

    count: float = 0.0
    sum: float = 0.0
    buckets: list[tuple[float, float]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class LMCacheMPSample(Observation):
    used_bytes: dict[str, float] = field(default_factory=dict)  # tier -> bytes in use
    capacity_bytes: dict[str, float] = field(default_factory=dict)  # tier -> capacity (cpu from /status)
    usage_ratio: dict[str, float] = field(default_factory=dict)  # tier -> 0..1
    objects: dict[str, int] = field(default_factory=dict)  # tier -> chunk objects (cpu from /status)
    hit_tokens_by_tier: dict[str, float] = field(default_factory=dict)  # lookups hit in cpu (L1) / disk (L2)
    hit_keys_by_tier: dict[str, float] = field(default_factory=dict)
    counters: dict[str, float] = field(default_factory=dict)  # see _COUNTERS values
    active_prefetch_jobs: float = 0.0
    reuse_gap_seconds: HistogramSummary = field(default_factory=HistogramSummary)
    healthy: bool | None = None  # /status is_healthy
    chunk_size: int | None = None  # tokens per chunk (/status)
    families: int = 0  # lmcache_mp_* families seen
    broken_blocks: int = 0  # unparseable text blocks skipped


def _sum(p: ParsedText, name: str) -> float:
    return float(sum(s.value for s in p.get(PREFIX + name)))


def _hist(p: ParsedText, base: str) -> HistogramSummary:
    b: dict[float, float] = {}
    for s in p.get(PREFIX + base + "_bucket"):
        le = float(s.labels.get("le", "inf"))
        b[le] = b.get(le, 0.0) + s.value
    return HistogramSummary(_sum(p, base + "_count"), _sum(p, base + "_sum"), sorted(b.items()))


def parse_lmcache_mp(
    metrics_text: str, status: dict[str, Any] | None, *, collector: str = "lmcache_mp", now: float = 0.0
) -> LMCacheMPSample:
    """Pure: ``/metrics`` text (+ optional ``/status`` JSON) -> :class:`LMCacheMPSample`.

    Raises ValueError when the text has no ``lmcache_mp_`` family at all (not an LMCache MP server)."""
    p = parse_families(metrics_text, keep=READ_SAMPLES)
    fams = [n for n in p.types if n.startswith(PREFIX)]
    if not fams:
        raise ValueError("no lmcache_mp_* metric families in the scraped text")
    cpu, disk = Tier.CPU.value, Tier.DISK.value
    used = {cpu: _sum(p, "l1_memory_usage_bytes"), disk: _sum(p, "l2_usage_bytes")}
    ratio_samples = p.get(PREFIX + "l1_usage_ratio")
    ratio = {cpu: max(s.value for s in ratio_samples)} if ratio_samples else {}
    cap: dict[str, float] = {}
    objects: dict[str, int] = {}
    healthy = chunk = None
    if status:
        healthy = bool(status.get("is_healthy"))
        chunk = int(status["chunk_size"]) if "chunk_size" in status else None
        l1s = ((status.get("storage_manager") or {}).get("l1_managers") or {}).values()
        l1s = [m for m in l1s if isinstance(m, dict)]
        if l1s:
            objects[cpu] = sum(int(m.get("total_object_count", 0)) for m in l1s)
            cap[cpu] = float(sum(m.get("memory_total_bytes", 0) for m in l1s))
    return LMCacheMPSample(
        collector=collector,
        timestamp=now,
        used_bytes=used,
        capacity_bytes=cap,
        usage_ratio=ratio,
        objects=objects,
        hit_tokens_by_tier={
            cpu: _sum(p, "lookup_hit_l1_tokens_total"),
            disk: _sum(p, "lookup_hit_l2_tokens_total"),
        },
        hit_keys_by_tier={
            cpu: _sum(p, "lookup_hit_l1_keys_total"),
            disk: _sum(p, "lookup_hit_l2_keys_total"),
        },
        counters={field_: _sum(p, name) for name, field_ in _COUNTERS.items()},
        active_prefetch_jobs=_sum(p, "active_prefetch_jobs"),
        reuse_gap_seconds=_hist(p, _REUSE_GAP),
        healthy=healthy,
        chunk_size=chunk,
        families=len(fams),
        broken_blocks=p.broken_blocks,
    )


@dataclass(frozen=True, slots=True)
class LMCacheMPRaw:
    metrics_text: str
    status: dict[str, Any] | None


class LMCacheMPCollector(HttpPeerCollector[LMCacheMPRaw, LMCacheMPSample]):
    """Scrapes one LMCache MP server's HTTP port (``/metrics``, and ``/status`` when it answers)."""

    kind = "lmcache_mp"

    async def fetch(self) -> LMCacheMPRaw:
        r = await self.get("/metrics")
        status: dict[str, Any] | None = None
        try:
            s = await self.get("/status")
            status = s.json()
        except Exception as exc:  # noqa: BLE001 - metrics alone are still useful
            self.count_error("status", exc)
        return LMCacheMPRaw(r.text, status)

    def parse(self, raw: LMCacheMPRaw, now: float) -> LMCacheMPSample:
        obs = parse_lmcache_mp(raw.metrics_text, raw.status, collector=self.name, now=now)
        if obs.broken_blocks:
            self.count_error("metrics_text", f"{obs.broken_blocks} broken blocks skipped")
        return obs
