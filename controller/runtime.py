"""Wiring of the control plane: loop + store + pins + models + actuators + API context (no globals).

``kvtier serve`` and the tests build it the same way; collectors own the index and feed it from KV events,
and call :meth:`ControlPlane.on_block_stored` (tokens for warm-ups) and :meth:`ReconcileLoop.wake`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI
from opentelemetry.trace import Tracer
from prometheus_client import CollectorRegistry

from kvtier.controller.actuators.base import Actuator
from kvtier.controller.api import ControlContext, add_control_routes, engine_tokenizer
from kvtier.controller.decisions import DecisionLog
from kvtier.controller.loop import ReconcileLoop
from kvtier.controller.metrics import ControllerMetrics
from kvtier.controller.model import ModelManager
from kvtier.controller.pins import PinSet
from kvtier.controller.policy_doc import Mode, PolicyDoc
from kvtier.controller.store import StateStore
from kvtier.controller.tokens import TokenStore
from kvtier.policies.index import BlockIndex

ACTUATOR_NAMES = ("shadow", "vllm-warmup", "lmcache-mp", "mooncake", "lmcache-controller")


def make_actuator(
    name: str, *, engine_url: str | None, engine_model: str, lmcache_url: str | None = None, **kw: Any
) -> Actuator:
    """Build a named actuator (``--actuator NAME``); cache-layer adapters are imported lazily."""
    if name == "shadow":
        from kvtier.controller.actuators.shadow import ShadowActuator

        return ShadowActuator()
    if name == "vllm-warmup":
        if not engine_url:
            raise ValueError("--actuator vllm-warmup needs --engine-url")
        from kvtier.controller.actuators.vllm_warmup import VllmWarmupActuator

        return VllmWarmupActuator(engine_url, engine_model, **kw)
    if name == "lmcache-mp":
        if not lmcache_url:
            raise ValueError("--actuator lmcache-mp needs --lmcache-url")
        from kvtier.controller.actuators.lmcache_mp import LMCacheMPActuator
        from kvtier.controller.actuators.resilience import HttpCaller

        return LMCacheMPActuator(HttpCaller(lmcache_url), **kw)
    raise ValueError(f"unknown or unavailable actuator {name!r}; known: {', '.join(ACTUATOR_NAMES)}")


@dataclass
class ControlPlane:
    loop: ReconcileLoop
    ctx: ControlContext
    store: StateStore
    http: httpx.AsyncClient | None = None
    _task: asyncio.Task[None] | None = None
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    def on_block_stored(
        self, hashes: Sequence[int], parent: int | None, token_ids: Sequence[int], block_size: int
    ) -> None:
        """Feed a ``BlockStored`` event's tokens (for warm-ups) and wake the loop."""
        self.loop.tokens.on_block_stored(hashes, parent, token_ids, block_size)
        self.loop.wake()

    def mount(self, app: FastAPI, *, with_status: bool = False) -> None:
        add_control_routes(app, self.ctx, with_status=with_status)

    async def start(self) -> None:
        self._stop = asyncio.Event()
        self._task = asyncio.create_task(self.loop.run(self._stop))

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, timeout=self.loop.policy.tick_timeout_s + 5)
        for a in self.loop.actuators:
            with contextlib.suppress(Exception):
                a.close()
        if self.http is not None:
            await self.http.aclose()
        self.store.close()


def build_control_plane(
    index: BlockIndex,
    *,
    registry: CollectorRegistry,
    state_dir: str | Path,
    mode: Mode | None = None,
    actuators: Sequence[Actuator] = (),
    tracer: Tracer | None = None,
    clock: Callable[[], float] = time.time,
    api_token: str | None = None,
    engine_url: str | None = None,
    engine_model: str = "",
    http: httpx.AsyncClient | None = None,
    policy: PolicyDoc | None = None,
) -> ControlPlane:
    """Restore persisted policy/pins/model from ``state_dir``; ``mode`` (CLI) overrides the stored mode."""
    store = StateStore(state_dir)
    metrics = ControllerMetrics(registry, layers=[a.name for a in actuators])
    doc = policy or PolicyDoc()
    loop = ReconcileLoop(
        index,
        policy=doc,
        actuators=actuators,
        pins=PinSet(),
        tokens=TokenStore(),
        decisions=DecisionLog(),
        metrics=metrics,
        tracer=tracer,
        clock=clock,
        model=engine_model,
    )
    models = ModelManager(loop, store)
    tokenizer = None
    if engine_url:
        http = http or httpx.AsyncClient(timeout=10.0)
        tokenizer = engine_tokenizer(engine_url, http)
    ctx = ControlContext(
        loop, store, models, api_token=api_token, tokenizer=tokenizer, engine_model=engine_model, clock=clock
    )
    ctx.restore()
    if mode is not None:
        loop.set_policy((loop._pending_policy or loop.policy).model_copy(update={"mode": mode}))
    loop._commit_policy()
    models.maybe_snapshot()
    return ControlPlane(loop, ctx, store, http)


def create_control_app(plane: ControlPlane, registry: CollectorRegistry) -> FastAPI:
    """A standalone app (policy API, /metrics, /v1/status); the sidecar mounts the same routes on its own."""
    from prometheus_client import make_asgi_app

    app = FastAPI(title="kvtier control", version="0.1.0")
    plane.mount(app, with_status=True)
    app.mount("/metrics", make_asgi_app(registry=registry))
    return app
