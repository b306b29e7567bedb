"""The live sidecar's per-tier view: where prefix hits were served from, and what each tier holds.

Built from the collectors' latest observations (no I/O here):

* ``gpu`` hits = vLLM's ``prefix_cache_hits`` (tokens; summed over engines / DP ranks), lookups = vLLM's
  ``prefix_cache_queries`` (tokens) -- the denominator of the per-tier hit ratio;
* ``cpu`` / ``disk`` hits = LMCache MP's ``lookup_hit_l1_tokens`` / ``lookup_hit_l2_tokens`` (summed over
  servers); used bytes, capacity and chunk objects per tier from its ``/metrics`` and ``/status``.

The counters are the peers' own cumulative values, so they equal what vLLM and LMCache report (a peer
restart resets them, which Prometheus' ``rate()`` treats as a counter reset). LMCache looks up the whole
prompt, so its L1/L2 hits may include a prefix vLLM's GPU cache also held: per-tier hit ratios can sum
past 1 by at most the GPU share. :class:`PerTierViewExporter` serves the view as the dashboards'
``kvtier_tier_*`` families (``dashboards/METRICS.md``); the demo serves the same families from its emulated
cache instead.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector as PromCollector

from kvtier.controller.tier_metrics import TIER_NAMES
from kvtier.policies.tiers import Tier

if TYPE_CHECKING:
    from kvtier.collectors.lmcache_mp import LMCacheMPSample
    from kvtier.collectors.vllm_metrics import EngineSample


@dataclass(frozen=True, slots=True)
class PerTierView:
    """Per-tier hits (tokens, cumulative), lookups (tokens), bytes used / capacity and objects held."""

    hit_tokens: dict[str, float] = field(default_factory=dict)
    lookup_tokens: float = 0.0
    used_bytes: dict[str, float] = field(default_factory=dict)
    capacity_bytes: dict[str, float] = field(default_factory=dict)
    objects: dict[str, int] = field(default_factory=dict)  # cpu: LMCache L1 chunks

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def build_tier_view(engines: Iterable[EngineSample], layers: Iterable[LMCacheMPSample]) -> PerTierView:
    """Pure: the latest engine samples and LMCache MP samples -> :class:`PerTierView` (tiers without a source
    of data are absent from the dicts)."""
    hits: dict[str, float] = {}
    used: dict[str, float] = {}
    cap: dict[str, float] = {}
    objects: dict[str, int] = {}
    lookups = 0.0
    for e in engines:
        hits[Tier.GPU.value] = hits.get(Tier.GPU.value, 0.0) + e.prefix_cache_hits
        lookups += e.prefix_cache_queries
    for s in layers:
        for src, dst in ((s.hit_tokens_by_tier, hits), (s.used_bytes, used), (s.capacity_bytes, cap)):
            for tier, v in src.items():
                dst[tier] = dst.get(tier, 0.0) + v
        for tier, n in s.objects.items():
            objects[tier] = objects.get(tier, 0) + n
    return PerTierView(hits, lookups, used, cap, objects)


class PerTierViewExporter(PromCollector):
    """Serves ``view()`` at scrape time: ``kvtier_tier_hit_tokens_total{tier}``,
    ``kvtier_lookup_tokens_total``, ``kvtier_tier_used_bytes{tier}``, ``kvtier_tier_capacity_bytes{tier}``
    and ``kvtier_tier_objects{tier}``. Hits and objects are exported for every tier (0 where no peer reports
    them); bytes only for the tiers a peer reports (``used / capacity`` must never divide by a made-up 0)."""

    def __init__(self, view: Callable[[], PerTierView]) -> None:
        self.view = view

    def collect(self) -> Iterable[Metric]:
        return _families(self.view())

    def describe(self) -> Iterable[Metric]:
        """Names only, so the registry catches a clash with another exporter of these families."""
        return _families(PerTierView())


def _families(v: PerTierView) -> list[Metric]:
    hits = CounterMetricFamily("kvtier_tier_hit_tokens", "Prefix tokens served from the tier.",
                               labels=["tier"])  # fmt: skip
    used = GaugeMetricFamily("kvtier_tier_used_bytes", "Bytes resident in the tier.", labels=["tier"])
    cap = GaugeMetricFamily("kvtier_tier_capacity_bytes", "Capacity of the tier, bytes.", labels=["tier"])
    objs = GaugeMetricFamily("kvtier_tier_objects", "KV chunks the cache layer holds in the tier.",
                             labels=["tier"])  # fmt: skip
    for t in TIER_NAMES:
        hits.add_metric([t], v.hit_tokens.get(t, 0.0))
        objs.add_metric([t], float(v.objects.get(t, 0)))
    # bytes only where a peer reports them: a made-up 0 capacity would turn used/capacity into +Inf
    for t, b in v.used_bytes.items():
        used.add_metric([t], b)
    for t, b in v.capacity_bytes.items():
        cap.add_metric([t], b)
    lookups = CounterMetricFamily("kvtier_lookup_tokens", "Prefix tokens looked up (vLLM prefix cache).")
    lookups.add_metric([], v.lookup_tokens)
    return [hits, lookups, used, cap, objs]
