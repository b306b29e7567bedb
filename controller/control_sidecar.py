"""The sidecar with its control plane: collectors + reconcile loop + policy API on one app.

:class:`ControlSink` is the collectors' ingestor's sink: after the block index took a batch, it feeds the
placement policy's request inference and, for ``BlockStored`` events, the token store used by warm-ups; then
it wakes the loop (events never carry state into the loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import httpx
from fastapi import FastAPI

from kvtier.collectors.kv_ingest import KvIngestor
from kvtier.collectors.vllm_events import BlockStored, DecodedBatch, block_key
from kvtier.controller.api import status_extra
from kvtier.controller.app import create_app
from kvtier.controller.geometry import EngineGeometry, apply_geometry, fetch_geometry
from kvtier.controller.l1_keeper import L1Keeper, keeper_hook
from kvtier.controller.policy_doc import PolicyDoc
from kvtier.controller.runtime import ControlPlane, build_control_plane, make_actuator
from kvtier.controller.settings import LMCacheL1Settings, LMCacheMPSettings, Settings, VllmWarmupSettings
from kvtier.controller.sidecar import Sidecar
from kvtier.controller.tracing import instrument_app, instrument_http, make_tracer, make_tracer_provider
from kvtier.policies.index import BlockIndex

log = logging.getLogger(__name__)


class ControlSink:
    """The control plane's :class:`~kvtier.collectors.kv_ingest.BatchSink`: block tokens, requests for the
    placement policy, a loop wake-up after each batch."""

    feed_per_batch = 16  # requests served through the placement policy per batch (~0.4 ms each, learned)

    def __init__(
        self,
        plane: ControlPlane,
        on_stored: Callable[[int | None, Sequence[int], int], None] | None = None,
    ) -> None:
        """``on_stored``: also fed (parent, block hashes, block size) of every ``BlockStored`` (the L1
        keeper's hook)."""
        self.plane = plane
        self.on_stored = on_stored

    def on_batch(self, engine: str, batch: DecodedBatch) -> None:
        plane = self.plane
        pl = plane.loop.placement
        if pl is not None:  # request-shaped accesses for the placement policy
            try:
                pl.requests.on_events(batch.events)
            except Exception as exc:  # noqa: BLE001 - a bad event must not stop ingestion
                pl.requests.counts["skipped_events"] += 1
                log.warning("request inference: skipped a batch: %s", exc)
            try:  # serve them now, off the tick's path (bounded; skipped while a tick holds the policy)
                pl.feed(self.feed_per_batch)
            except Exception as exc:  # noqa: BLE001 - a policy bug must not stop ingestion
                pl.errors += 1
                log.warning("placement policy: feeding failed: %s", exc)
        tokens = plane.loop.tokens
        for e in batch.events:
            if type(e) is BlockStored and e.block_size > 0:
                try:
                    toks = e.tokens()
                    parent = None if e.parent_block_hash is None else block_key(e.parent_block_hash)
                    keys = [block_key(h) for h in e.block_hashes]
                    tokens.on_block_stored(keys, parent, toks, e.block_size)
                    if self.on_stored is not None:
                        self.on_stored(parent, keys, e.block_size)
                except Exception as exc:  # noqa: BLE001 - a bad event must not stop ingestion
                    log.warning("token store: skipped a BlockStored event: %s", exc)
        plane.loop.wake()


class ControlledSidecar(Sidecar):
    """:class:`Sidecar` + :class:`ControlPlane`: ``/v1/status`` gains mode, actuator health, last tick."""

    def __init__(self, settings: Settings, *, reset_state: bool = False, **kw: Any) -> None:
        if reset_state:
            reset_persisted_policy(settings.serve.state_dir)
        col = settings.collectors
        ing = kw.pop("ingestor", None) or KvIngestor(BlockIndex(max_blocks=col.index_max_blocks))
        super().__init__(settings, ingestor=ing, **kw)
        engine_url = col.engine_urls[0] if col.engine_urls else None
        model = col.engine_model or (discover_model(engine_url) if engine_url else "")
        acts = []
        keeper: LMCacheL1Settings | None = None
        for spec in settings.actuators:
            if isinstance(spec, LMCacheL1Settings):  # acts on LMCache L1 by itself (not a planner actuator)
                keeper = spec
                continue
            extra: dict[str, Any] = {}
            # the entry's fields as the factory's keywords (as objects: ``memory`` carries a live layer)
            options = {k: v for k, v in spec if k != "kind" and v is not None}
            if isinstance(spec, VllmWarmupSettings):
                from kvtier.controller.actuators.vllm_warmup import WarmupBudget

                extra["budget"] = WarmupBudget(options.pop("tokens_per_s"), options.pop("requests_per_s"))
            if isinstance(spec, LMCacheMPSettings) and "model_name" not in options and engine_url:
                # LMCache keys name the model by vLLM's --model path (/v1/models "root"), not the served name
                options["model_name"] = discover_model(engine_url, field="root") or model
            acts.append(make_actuator(spec.kind, engine_url=engine_url, engine_model=model,
                                      lmcache_url=col.lmcache_urls[0] if col.lmcache_urls else None,
                                      lmcache_controller_url=col.lmcache_controller_urls[0]
                                      if col.lmcache_controller_urls else None,
                                      options=options, **extra))  # fmt: skip
        self.tracer_provider = make_tracer_provider()
        instrument_http(self.tracer_provider)  # actuations' peer calls become child spans
        self.plane = build_control_plane(
            self.ingestor.index, registry=self.registry, state_dir=settings.serve.state_dir,
            mode=settings.serve.mode, actuators=acts, tracer=make_tracer(self.tracer_provider),
            clock=self.clock,
            api_token=settings.serve.api_token, engine_url=engine_url, engine_model=model, http=self.client,
            policy=PolicyDoc.model_validate(settings.policy_doc_seed()),
            placement_policy=None if settings.loop.policy == "none" else settings.loop.policy,
            placement_tier=settings.loop.policy_tier, placement_options=settings.learned.options(),
            allow_active=settings.serve.allow_active, api_options=api_options(settings),
        )  # fmt: skip
        self.plane.http = None  # the sidecar owns the shared client
        self.engine_url = engine_url
        self.geometry: EngineGeometry | None = None
        persisted = self.plane.store.get_json("policy") is not None
        api = "api (persisted)"
        mode_src = "settings" if settings.serve.mode is not None else (api if persisted else "default")
        self.policy_source = {
            "mode": mode_src,
            "policy": api if persisted else "default",
            "state_dir": settings.serve.state_dir,
        }
        self._geometry_task: asyncio.Task[None] | None = None
        self.l1_keeper: L1Keeper | None = None
        if keeper is not None:
            self.l1_keeper = build_keeper(self, keeper, engine_url)
        hook = keeper_hook(self.l1_keeper) if self.l1_keeper is not None else None
        self.ingestor.sinks.append(ControlSink(self.plane, on_stored=hook))

    async def start(self) -> None:
        await super().start()
        await self.plane.start()
        if self.l1_keeper is not None:
            self.l1_keeper.start()
        if self.engine_url and self.policy_source["policy"] == "default":
            self._geometry_task = asyncio.create_task(self._discover_geometry(self.engine_url))

    async def _discover_geometry(self, engine_url: str) -> None:
        """Poll the engine's ``vllm:cache_config_info`` until it answers (as a native sidecar kvtier starts
        before vLLM), then size the policy from it unless an API change came first."""
        while True:
            geo = await fetch_geometry(self.client, engine_url, self.settings.collectors.http_timeout_s)
            if geo is not None:
                break
            await asyncio.sleep(self.settings.collectors.scrape_interval_s)
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

    async def stop(self) -> None:
        if self.l1_keeper is not None:
            self.l1_keeper.stop()
        if self._geometry_task is not None:
            self._geometry_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._geometry_task
        await self.plane.stop()
        await super().stop()
        self.tracer_provider.shutdown()

    def status(self) -> dict[str, Any]:
        out = super().status()
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


def reset_persisted_policy(state_dir: str) -> bool:
    """``--reset-state``: forget the policy persisted by the API (pins and trained models are kept)."""
    from kvtier.controller.store import StateStore

    store = StateStore(state_dir)
    try:
        dropped = store.delete_key("policy")
    finally:
        store.close()
    if dropped:
        log.warning("--reset-state: dropped the policy persisted in %s", state_dir)
    return dropped


def api_options(settings: Settings) -> dict[str, Any]:
    """The API's hardening options from the settings (Host allow-list derived from ``--listen``)."""
    from kvtier.controller.guard import allowed_hosts_for

    sv = settings.serve
    host, _ = sv.listen_host_port
    return {
        "allowed_hosts": allowed_hosts_for(host, sv.allowed_hosts),
        "max_body_bytes": sv.max_body_bytes,
        "max_inflight": sv.http_max_inflight,
        "max_pins": sv.max_pins,
        "max_pinned_tokens": sv.max_pinned_tokens,
        "max_pin_tokens": sv.max_pin_tokens,
    }


def build_keeper(sc: ControlledSidecar, spec: LMCacheL1Settings, engine_url: str | None) -> L1Keeper:
    """``--actuator lmcache-l1``: the LMCache MP L1 keeper (:mod:`kvtier.controller.l1_keeper`), acting
    through its own lmcache-mp adapter on the first ``--lmcache-url``. Feed it with :func:`keeper_hook`."""
    from kvtier.controller.actuators import lmcache_mp

    urls = sc.settings.collectors.lmcache_urls
    if not urls:
        raise ValueError("--actuator lmcache-l1 needs --lmcache-url")
    model = spec.model_name or (discover_model(engine_url, field="root") if engine_url else "")
    act = lmcache_mp.build(urls[0], model_name=model)
    plane = sc.plane
    assert plane is not None
    acts = plane.loop.metrics.actuations

    def record(what: str, n: int) -> None:  # "action:outcome"
        action, _, outcome = what.partition(":")
        acts.labels(layer="lmcache-mp", action=action, outcome=outcome).inc(n)

    keeper = L1Keeper(act, chain_tokens=plane.loop.tokens.chain_tokens,
                      is_active=lambda: plane.loop.mode == "active", registry=sc.registry,
                      record=record, **spec.keeper_options())  # fmt: skip
    return keeper


def discover_model(engine_url: str, timeout_s: float = 5.0, field: str = "id") -> str:
    """First model of a vLLM server (``GET /v1/models``): its served name (``id``) or its ``--model``
    path (``root``); "" when unreachable."""
    try:
        r = httpx.get(engine_url.rstrip("/") + "/v1/models", timeout=timeout_s)
        r.raise_for_status()
        return str(r.json()["data"][0][field])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        log.warning(
            "could not discover the served model of %s (%s); set KVTIER_ENGINE_MODEL", engine_url, exc
        )
        return ""


def create_controlled_app(sidecar: ControlledSidecar, *, manage_lifecycle: bool = True) -> FastAPI:
    """Collectors' app (/metrics, /v1/status, /healthz, /readyz) + the policy API; OpenAPI at /docs."""
    app = create_app(sidecar, manage_lifecycle=manage_lifecycle)
    sidecar.plane.mount(app)
    instrument_app(app, sidecar.tracer_provider)
    return app
