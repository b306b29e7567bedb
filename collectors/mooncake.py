"""Mooncake Store master collector: ``GET /metrics`` (136 families) + ``GET /metrics/summary``.

Tiers (kvtier names): memory segments -> ``cpu``, SSD / file storage -> ``disk``, NVMe-oF -> ``remote``.
Units: bytes, keys, requests (counters are cumulative since master start).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from kvtier.policies.tiers import normalize_tier

from .base import HttpPeerCollector, Observation
from .promtext import ParsedText, parse_families

# tier spelling (Mooncake) -> (allocated sample, capacity sample)
_TIER_BYTES = {
    "memory": ("master_allocated_bytes", "master_total_capacity_bytes"),
    "ssd": ("master_allocated_file_size_bytes", "master_total_file_capacity_bytes"),
    "nof": ("master_nof_allocated_bytes", "master_total_nof_capacity_bytes"),
}
_EVICTION = (
    "master_evicted_key_count",
    "master_evicted_size_bytes",
    "master_attempted_evictions_total",
    "master_successful_evictions_total",
    "master_evicted_key_count_mem",
    "master_evicted_key_count_nof",
    "master_attempted_evictions_mem",
    "master_attempted_evictions_nof",
    "master_successful_evictions_mem",
    "master_successful_evictions_nof",
)
_RPC = re.compile(r"^master_(?P<rpc>[a-z_]+?)_(?P<what>requests|failures)_total$")


@dataclass(frozen=True, slots=True)
class MooncakeSummary:
    """Parsed ``/metrics/summary`` header (role, state, keys, clients)."""

    role: str = ""
    state: str = ""
    service_ready: bool | None = None
    keys: int | None = None
    soft_pinned: int | None = None
    clients: int | None = None


@dataclass(frozen=True, slots=True)
class MooncakeSample(Observation):
    key_count: float = 0.0
    soft_pin_key_count: float = 0.0
    active_clients: float = 0.0
    allocated_bytes: dict[str, float] = field(default_factory=dict)  # tier -> bytes
    capacity_bytes: dict[str, float] = field(default_factory=dict)  # tier -> bytes
    segments: dict[str, dict[str, float]] = field(default_factory=dict)  # segment -> allocated/capacity
    eviction: dict[str, float] = field(default_factory=dict)  # sample name -> value
    promotion: dict[str, float] = field(default_factory=dict)  # master_promotion_* -> value
    nof: dict[str, float] = field(default_factory=dict)  # master_nof_* -> value
    rpc_requests: dict[str, float] = field(default_factory=dict)  # rpc -> requests
    rpc_failures: dict[str, float] = field(default_factory=dict)  # rpc -> failures
    cache_hits: dict[str, float] = field(default_factory=dict)  # tier -> hit count (mem/file)
    summary: MooncakeSummary | None = None
    families: int = 0
    broken_blocks: int = 0


def _samples(p: ParsedText, name: str) -> list[Any]:
    """Samples of ``name``; prometheus_client renames counter samples w/o ``_total`` to ``name_total``."""
    return p.get(name) or p.get(name + "_total")


def _one(p: ParsedText, name: str) -> float:
    return float(sum(s.value for s in _samples(p, name)))


def parse_summary(text: str) -> MooncakeSummary:
    """Pure: the summary line ``role=leader, state=serving, service_ready=true, master={... Keys: 4
    (soft-pinned: 0) | Clients: 2 | ...}``."""

    def grab(pat: str) -> str | None:
        m = re.search(pat, text)
        return m.group(1) if m else None

    ready = grab(r"service_ready=(\w+)")
    keys, pinned, clients = (grab(r"Keys:\s*(\d+)"), grab(r"soft-pinned:\s*(\d+)"), grab(r"Clients:\s*(\d+)"))
    return MooncakeSummary(
        role=grab(r"role=(\w+)") or "",
        state=grab(r"state=(\w+)") or "",
        service_ready=None if ready is None else ready == "true",
        keys=None if keys is None else int(keys),
        soft_pinned=None if pinned is None else int(pinned),
        clients=None if clients is None else int(clients),
    )


def parse_mooncake(
    metrics_text: str, summary_text: str | None = None, *, collector: str = "mooncake", now: float = 0.0
) -> MooncakeSample:
    """Pure: master ``/metrics`` (+ ``/metrics/summary``) -> :class:`MooncakeSample`.

    Raises ValueError when no ``master_*`` family is present (not a Mooncake master)."""
    p = parse_families(metrics_text)
    if not any(n.startswith("master_") for n in p.types):
        raise ValueError("no master_* metric families in the scraped text")
    alloc: dict[str, float] = {}
    cap: dict[str, float] = {}
    for spelling, (a, c) in _TIER_BYTES.items():
        t = normalize_tier(spelling).value
        alloc[t] = _one(p, a)
        cap[t] = _one(p, c)
    segs: dict[str, dict[str, float]] = {}
    for sname, key in (
        ("segment_allocated_bytes", "allocated_bytes"),
        ("segment_total_capacity_bytes", "capacity_bytes"),
    ):
        for s in _samples(p, sname):
            seg = s.labels.get("segment", "")
            segs.setdefault(seg, {})[key] = float(s.value)
    req: dict[str, float] = {}
    fail: dict[str, float] = {}
    promo: dict[str, float] = {}
    nof: dict[str, float] = {}
    for name, samples in p.samples.items():
        v = float(sum(s.value for s in samples))
        m = _RPC.match(name)
        if m:
            (req if m.group("what") == "requests" else fail)[m.group("rpc")] = v
        if name.startswith("master_promotion_"):
            promo[name] = v
        if name.startswith("master_nof_") or "_nof_" in name:
            nof[name] = v
    return MooncakeSample(
        collector=collector,
        timestamp=now,
        key_count=_one(p, "master_key_count"),
        soft_pin_key_count=_one(p, "master_soft_pin_key_count"),
        active_clients=_one(p, "master_active_clients"),
        allocated_bytes=alloc,
        capacity_bytes=cap,
        segments=segs,
        eviction={n: _one(p, n) for n in _EVICTION if _samples(p, n)},
        promotion=promo,
        nof=nof,
        rpc_requests=req,
        rpc_failures=fail,
        cache_hits={"cpu": _one(p, "mem_cache_hit_nums_"), "disk": _one(p, "file_cache_hit_nums_")},
        summary=parse_summary(summary_text) if summary_text else None,
        families=len(p.types),
        broken_blocks=p.broken_blocks,
    )


@dataclass(frozen=True, slots=True)
class MooncakeRaw:
    metrics_text: str
    summary_text: str | None


class MooncakeCollector(HttpPeerCollector[MooncakeRaw, MooncakeSample]):
    """Scrapes one Mooncake master's admin/metrics port (``-metrics_port``)."""

    kind = "mooncake"

    async def fetch(self) -> MooncakeRaw:
        r = await self.get("/metrics")
        summary: str | None = None
        try:
            s = await self.get("/metrics/summary")
            summary = s.text
        except Exception as exc:  # noqa: BLE001
            self.count_error("summary", exc)
        return MooncakeRaw(r.text, summary)

    def parse(self, raw: MooncakeRaw, now: float) -> MooncakeSample:
        obs = parse_mooncake(raw.metrics_text, raw.summary_text, collector=self.name, now=now)
        if obs.broken_blocks:
            self.count_error("metrics_text", f"{obs.broken_blocks} broken blocks skipped")
        return obs
