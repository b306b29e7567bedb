"""The built-in status page at ``/`` and the JSON it polls (``/v1/history``), for both serve and demo.

:class:`History` samples the sidecar's own registry every ``interval_s`` (tier usage/capacity, hit tokens,
lookups, bytes moved per link, decisions, shadow scoring, predictor AUC) into a bounded ring; the page
(``controller/static/status.html``, package data, no CDN) draws it as inline SVG and polls ``/v1/history``,
``/v1/decisions`` and ``/v1/model``. The same task refreshes :class:`PlaneGauges`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

from fastapi import FastAPI, Query
from fastapi.responses import HTMLResponse
from prometheus_client import CollectorRegistry

from kvtier.controller.tier_metrics import TIER_NAMES, PlaneGauges

log = logging.getLogger(__name__)


Samples = dict[str, list[tuple[dict[str, str], float]]]  # sample name -> [(labels, value)]


def sampled_families(registry: CollectorRegistry, names: set[str]) -> Samples:
    """Samples of ``names`` (sample names), collected from only the collectors that declare those families
    (the registry's restricted view): a whole collect every ``interval_s`` walked every family of the
    sidecar, engine-side KV-event exporters included, and cost the sidecar CPU on the engine's host."""
    out: Samples = {n: [] for n in names}
    for fam in registry.restricted_registry(names).collect():
        for s in fam.samples:
            if s.name in out:
                out[s.name].append((dict(s.labels), float(s.value)))
    return out


HISTORY_SAMPLES = {
    "kvtier_tier_used_bytes",
    "kvtier_tier_capacity_bytes",
    "kvtier_tier_hit_tokens_total",
    "kvtier_lookup_tokens_total",
    "kvtier_tier_moved_bytes_total",
    "kvtier_blocks_tracked",
    "kvtier_decisions_total",
    "kvtier_shadow_hits_total",
    "kvtier_shadow_scored_total",
    "kvtier_predictor_auc",
    "kvtier_guard_acting",
    "kvtier_guard_trips_total",
    "kvtier_guard_resumes_total",
}


class History:
    """Ring of registry samples (one dict per ``interval_s``; wall-clock ``t`` in seconds)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        interval_s: float = 1.0,
        size: int = 600,
        clock: Callable[[], float] = time.time,
        on_sample: Callable[[], None] | None = None,
    ) -> None:
        self.registry = registry
        self.interval_s = interval_s
        self.clock = clock
        self.on_sample = on_sample
        self.samples: deque[dict[str, Any]] = deque(maxlen=size)

    def sample(self) -> dict[str, Any]:
        if self.on_sample is not None:
            try:
                self.on_sample()
            except Exception:  # noqa: BLE001 - the page must keep working
                log.exception("status page: gauge refresh failed")
        f = sampled_families(self.registry, HISTORY_SAMPLES)

        def by(name: str, label: str) -> dict[str, float]:
            return {lab.get(label, ""): v for lab, v in f[name]}

        tiers: dict[str, dict[str, float]] = {t: {} for t in TIER_NAMES}
        for key, name in (
            ("used_bytes", "kvtier_tier_used_bytes"),
            ("capacity_bytes", "kvtier_tier_capacity_bytes"),
            ("hit_tokens", "kvtier_tier_hit_tokens_total"),
            ("blocks", "kvtier_blocks_tracked"),
        ):
            for tier, v in by(name, "tier").items():
                tiers.setdefault(tier, {})[key] = v
        moved = {f"{lab['src_tier']}->{lab['dst_tier']}": v for lab, v in f["kvtier_tier_moved_bytes_total"]}
        s = {
            "t": self.clock(),
            "tiers": tiers,
            "lookup_tokens": sum(v for _, v in f["kvtier_lookup_tokens_total"]),
            "moved_bytes": {k: v for k, v in moved.items() if v > 0},
            "decisions": sum(v for _, v in f["kvtier_decisions_total"]),
            "shadow_hits": sum(v for _, v in f["kvtier_shadow_hits_total"]),
            "shadow_scored": sum(v for _, v in f["kvtier_shadow_scored_total"]),
            "auc": next((v for _, v in f["kvtier_predictor_auc"]), None),
            # the L1 keeper's self-guard (absent without --actuator lmcache-l1): acting 1/0, trips, resumes
            "guard": None
            if not f["kvtier_guard_acting"]
            else {
                "acting": f["kvtier_guard_acting"][0][1],
                "trips": sum(v for _, v in f["kvtier_guard_trips_total"]),
                "resumes": sum(v for _, v in f["kvtier_guard_resumes_total"]),
            },
        }
        self.samples.append(s)
        return s

    def since(self, t: float) -> list[dict[str, Any]]:
        return [s for s in self.samples if s["t"] > t]

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await asyncio.to_thread(self.sample)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=self.interval_s)


def page_html() -> str:
    """The status page (package data)."""
    return resources.files("kvtier.controller").joinpath("static/status.html").read_text()


def install_status_page(app: FastAPI, registry: CollectorRegistry, *, interval_s: float = 1.0) -> History:
    """Serve ``/`` and ``/v1/history`` on ``app``; sample while the app runs (wraps its lifespan)."""
    ctx = getattr(app.state, "control", None)
    gauges = PlaneGauges(registry, layers=[a.name for a in ctx.loop.actuators] if ctx is not None else ())

    def refresh() -> None:
        if ctx is not None:
            gauges.refresh(ctx.models.info(), ctx.loop.status().get("actuators", []))

    hist = History(registry, interval_s=interval_s, on_sample=refresh)
    html = page_html()

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def index() -> HTMLResponse:
        return HTMLResponse(html)

    @app.get("/v1/history", tags=["status"])
    def history(
        since: float = Query(0.0, description="only samples newer than this (unix s)"),
    ) -> dict[str, Any]:
        """Samples of tier usage, hit tokens, bytes moved, decisions and predictor AUC over time."""
        return {"interval_s": hist.interval_s, "samples": hist.since(since)}

    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: Any) -> AsyncIterator[Any]:
        async with inner(a) as state:
            stop = asyncio.Event()
            task = asyncio.create_task(hist.run(stop))
            try:
                yield state
            finally:
                stop.set()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(task, timeout=5)

    app.router.lifespan_context = lifespan
    return hist
