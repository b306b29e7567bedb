"""LMCache legacy cache-controller collector: ``GET /controller/key-stats`` and ``GET /controller/workers``.

The controller keeps LMCache's registry (chunk key -> instance/worker/location) fed by the workers'
admit/evict messages; kvtier polls its counts. Units: keys, workers, seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .base import HttpPeerCollector, Observation


@dataclass(frozen=True, slots=True)
class ControllerWorker:
    instance_id: str
    worker_id: int
    ip: str
    port: int
    key_count: int
    heartbeat_age_s: float | None  # now - last_heartbeat_time (controller wall clock)


@dataclass(frozen=True, slots=True)
class LMCacheControllerSample(Observation):
    total_key_count: int = 0
    instance_count: int = 0
    worker_count: int = 0
    keys_by_instance: dict[str, int] = field(default_factory=dict)
    workers: list[ControllerWorker] = field(default_factory=list)


def parse_controller(
    key_stats: dict[str, Any],
    workers: dict[str, Any] | None,
    *,
    collector: str = "lmcache_controller",
    now: float = 0.0,
) -> LMCacheControllerSample:
    """Pure: the two JSON bodies -> sample. Raises ValueError on a body that is not key-stats."""
    if not isinstance(key_stats, dict) or "total_key_count" not in key_stats:
        raise ValueError(f"not a /controller/key-stats body: {str(key_stats)[:200]}")
    ws: list[ControllerWorker] = []
    for w in (workers or {}).get("workers") or []:
        if not isinstance(w, dict):
            continue
        hb = w.get("last_heartbeat_time")
        ws.append(
            ControllerWorker(
                str(w.get("instance_id", "")),
                int(w.get("worker_id", 0)),
                str(w.get("ip", "")),
                int(w.get("port") or 0),
                int(w.get("key_count") or 0),
                None if hb is None else max(0.0, now - float(hb)),
            )
        )
    return LMCacheControllerSample(
        collector=collector,
        timestamp=now,
        total_key_count=int(key_stats["total_key_count"]),
        instance_count=int(key_stats.get("total_instance_count", 0)),
        worker_count=int(key_stats.get("total_worker_count", 0)),
        keys_by_instance={
            str(i.get("instance_id")): int(i.get("key_count", 0))
            for i in key_stats.get("instances") or []
            if isinstance(i, dict)
        },
        workers=ws,
    )


@dataclass(frozen=True, slots=True)
class ControllerRaw:
    key_stats: Any
    workers: Any


class LMCacheControllerCollector(HttpPeerCollector[ControllerRaw, LMCacheControllerSample]):
    kind = "lmcache_controller"

    async def fetch(self) -> ControllerRaw:
        ks = await self.get("/controller/key-stats")
        wk = await self.get("/controller/workers")
        return ControllerRaw(ks.json(), wk.json())

    def parse(self, raw: ControllerRaw, now: float) -> LMCacheControllerSample:
        return parse_controller(raw.key_stats, raw.workers, collector=self.name, now=now)
