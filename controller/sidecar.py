"""The sidecar: collectors + control plane (+ the L1 keeper), started and stopped together.

:class:`Sidecar` only holds and sequences parts built by :func:`kvtier.controller.root.build_sidecar`; its
constructor does no I/O. :meth:`Sidecar.start` launches the collector loops, the reconcile loop, the periodic
retrain, the keeper and (while the policy is the default one) the engine-geometry discovery;
:meth:`Sidecar.stop` ends them in reverse. ``/v1/status`` is :meth:`Sidecar.status`: the collectors' view plus
mode, actuator health, last tick, policy source and engine geometry.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import httpx
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from kvtier.collectors.base import Clock
from kvtier.collectors.kv_ingest import KvIngestor
from kvtier.controller.api import status_extra
from kvtier.controller.collection import CollectorSet
from kvtier.controller.geometry import EngineGeometry, apply_geometry, fetch_geometry
from kvtier.controller.l1_keeper import L1Keeper
from kvtier.controller.plane import ControlPlane
from kvtier.controller.settings import Settings
from kvtier.controller.tier_view import PerTierView

log = logging.getLogger(__name__)


class Sidecar:
    """Collectors feeding the block index, and the control plane deciding over it."""

    def __init__(
        self,
        settings: Settings,
        *,
        collectors: CollectorSet,
        plane: ControlPlane,
        l1_keeper: L1Keeper | None,
        http: httpx.AsyncClient,
        owns_http: bool,
        tracer_provider: TracerProvider,
        engine_url: str | None,
        runs_plane: bool = True,
    ) -> None:
        """Parts from :func:`~kvtier.controller.root.build_sidecar`; ``owns_http``: :meth:`stop` closes
        ``http`` (False when the caller handed it in); ``runs_plane``: :meth:`start` starts the plane's
        wall-clock reconcile loop and retrain (False when a simulation ticks the loop on its own clock: a
        second driver's ticks at random simulated moments would make its runs differ)."""
        self.settings = settings
        self.collectors = collectors
        self.plane = plane
        self.l1_keeper = l1_keeper
        self.http = http
        self.owns_http = owns_http
        self.tracer_provider = tracer_provider
        self.engine_url = engine_url
        self.runs_plane = runs_plane
        self.geometry: EngineGeometry | None = None
        persisted = plane.store.get_json("policy") is not None
        api = "api (persisted)"
        mode_src = "settings" if settings.serve.mode is not None else (api if persisted else "default")
        self.policy_source = {
            "mode": mode_src,
            "policy": api if persisted else "default",
            "state_dir": settings.serve.state_dir,
        }
        self._geometry_task: asyncio.Task[None] | None = None

    # ---- shared parts -------------------------------------------------------------------------------------
    @property
    def registry(self) -> CollectorRegistry:
        """The prometheus registry every part registers its families in (served at ``/metrics``)."""
        return self.collectors.registry

    @property
    def ingestor(self) -> KvIngestor:
        """The KV-event ingestor that owns the block index."""
        return self.collectors.ingestor

    @property
    def clock(self) -> Clock:
        """The clock every part reads (seconds; simulated time in the demo)."""
        return self.collectors.clock

    # ---- lifecycle ----------------------------------------------------------------------------------------
    async def start(self) -> None:
        """Launch the collector loops, the reconcile loop and retrain, the keeper, the geometry discovery."""
        await self.collectors.start()
        if self.runs_plane:
            await self.plane.start()
        if self.l1_keeper is not None:
            self.l1_keeper.start()
        if self.engine_url and self.policy_source["policy"] == "default":
            self._geometry_task = asyncio.create_task(self._discover_geometry(self.engine_url))

    async def _discover_geometry(self, engine_url: str) -> None:
        """Poll the engine's ``vllm:cache_config_info`` until it answers (as a native sidecar kvtier starts
        before vLLM), then size the policy from it unless an API change came first."""
        col = self.settings.collectors
        while True:
            geo = await fetch_geometry(self.http, engine_url, col.http_timeout_s)
            if geo is not None:
                break
            await asyncio.sleep(col.scrape_interval_s)
        self.geometry = geo
        if self.plane.store.get_json("policy") is not None:
            log.info("engine geometry %s found, but a policy set through the API is in force", geo.to_dict())
            return
        loop = self.plane.loop
        loop.set_policy(apply_geometry(loop.next_policy, geo))
        if loop.placement is not None:  # events carry their block size; this is the fallback
            loop.placement.requests.block_size_tokens = geo.block_size_tokens
        self.policy_source["policy"] = f"discovered (vllm:cache_config_info of {engine_url})"
        log.info(
            "policy sized from %s: GPU tier %d blocks of %d tokens (vllm:cache_config_info)",
            engine_url, geo.num_gpu_blocks, geo.block_size_tokens,
        )  # fmt: skip

    async def poll_once(self) -> None:
        """Poll every collector once (for tests and warm-up)."""
        await self.collectors.poll_once()

    async def stop(self) -> None:
        """End everything :meth:`start` launched, close the actuators, the store and (if owned) the client."""
        if self.l1_keeper is not None:
            self.l1_keeper.stop()
        if self._geometry_task is not None:
            self._geometry_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._geometry_task
        await self.plane.stop()
        await self.collectors.stop()
        if self.owns_http:
            await self.http.aclose()
        self.tracer_provider.shutdown()

    # ---- views --------------------------------------------------------------------------------------------
    def tier_view(self) -> PerTierView:
        """Per-tier hits, lookups and holdings from the latest vLLM and LMCache MP observations."""
        return self.collectors.tier_view()

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        """(ready, detail) for ``/readyz``: see :meth:`CollectorSet.readiness`."""
        return self.collectors.readiness()

    def status(self) -> dict[str, Any]:
        """``GET /v1/status``: the collectors' view, the controller's, the policy's source."""
        out = self.collectors.status()
        out.update(status_extra(self.plane.ctx))
        if self.l1_keeper is not None:
            out["l1_keeper"] = self.l1_keeper.status()
        out["policy_source"] = dict(self.policy_source)
        out["engine_geometry"] = self.geometry.to_dict() if self.geometry is not None else None
        return out

    def startup_summary(self) -> str:
        """One line for the start-up log: what mode and policy are in force, and where they come from."""
        doc = self.plane.loop.next_policy
        gpu = next((t.capacity_blocks for t in doc.tiers if t.tier.value == "gpu"), None)
        src = self.policy_source
        line = (
            f"mode {doc.mode} (from {src['mode']}); policy from {src['policy']}: GPU tier {gpu} blocks of "
            f"{doc.block_size_tokens} tokens, placement {self.settings.loop.policy}"
        )
        if src["policy"].startswith("api"):
            line += (
                f"; a runtime change made through the API is in force (persisted in {src['state_dir']});"
                " kvtier serve --reset-state returns to the configured and discovered policy"
            )
        elif self.engine_url:
            line += "; the GPU tier is sized from the engine's vllm:cache_config_info once it answers"
        return line
