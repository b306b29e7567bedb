"""Wiring of the control plane: loop + store + pins + models + actuators + API context (no globals).

``kvtier serve`` and the tests build it the same way; collectors own the index and feed it from KV events,
and call :meth:`ControlPlane.on_block_stored` (tokens for warm-ups) and :meth:`ReconcileLoop.wake`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI
from fastapi_offline import FastAPIOffline
from opentelemetry.trace import Tracer
from prometheus_client import CollectorRegistry

from kvtier import __version__
from kvtier.collectors.kv_requests import RequestInferrer
from kvtier.controller.actuators.base import Actuator
from kvtier.controller.api import ControlContext, add_control_routes, engine_tokenizer
from kvtier.controller.decisions import DecisionLog
from kvtier.controller.loop import ReconcileLoop
from kvtier.controller.metrics import ControllerMetrics
from kvtier.controller.model import ModelManager
from kvtier.controller.pins import PinSet
from kvtier.controller.placement import PolicyPlacement
from kvtier.controller.policy_doc import Mode, PolicyDoc
from kvtier.controller.store import StateStore, StateStoreExporter
from kvtier.controller.tokens import TokenStore
from kvtier.policies.index import BlockIndex
from kvtier.policies.tiers import Tier, normalize_tier

log = logging.getLogger(__name__)


def make_actuator(
    name: str,
    *,
    engine_url: str | None,
    engine_model: str,
    lmcache_url: str | None = None,
    lmcache_controller_url: str | None = None,
    options: dict[str, Any] | None = None,
    **kw: Any,
) -> Actuator:
    """Build actuator ``name`` from :mod:`kvtier.controller.actuators.registry` with ``options`` (its
    factory keyword arguments, the ``actuators`` settings entry) plus ``kw``; the wiring values it takes
    (``registry.WIRING``: engine URL/model, ``--lmcache-url``, ``--lmcache-controller-url``) are filled in
    unless the options set them."""
    from kvtier.controller.actuators import registry

    if name not in registry.names():
        raise ValueError(f"unknown actuator {name!r}; known: {', '.join(registry.names())}")
    wiring = {"engine_url": engine_url, "engine_model": engine_model, "lmcache_url": lmcache_url,
              "lmcache_controller_url": lmcache_controller_url}  # fmt: skip
    opts = {**(options or {}), **kw}
    for arg, (source, flag) in registry.WIRING.get(name, {}).items():
        if arg in opts:
            continue
        value = wiring[source]
        if value is None:
            raise ValueError(f"--actuator {name} needs {flag}")
        opts[arg] = value
    try:
        return registry.build(name, **opts)
    except TypeError as exc:
        raise ValueError(
            f"actuator {name!r}: bad or missing options ({exc}); set them in the actuators settings"
        ) from exc


@dataclass
class ControlPlane:
    loop: ReconcileLoop
    ctx: ControlContext
    store: StateStore
    http: httpx.AsyncClient | None = None
    _task: asyncio.Task[None] | None = None
    _retrain_task: asyncio.Task[None] | None = None
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
        self._retrain_task = asyncio.create_task(self._retrain_periodically())

    async def _retrain_periodically(self) -> None:
        """Retrain every ``predictor.retrain_interval_s`` (0 = only on ``POST /v1/model/retrain``)."""
        while not self._stop.is_set():
            every = self.loop.policy.predictor.retrain_interval_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), timeout=every if every > 0 else 60.0)
            if self._stop.is_set() or every <= 0:
                continue
            try:
                await asyncio.to_thread(self.ctx.models.retrain)
            except ModelManager.NotTrainable as exc:
                log.info("periodic retrain skipped: %s", exc)
            except Exception:  # noqa: BLE001 - keep serving with the current model
                log.exception("periodic retrain failed")

    async def stop(self) -> None:
        self._stop.set()
        if self._retrain_task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._retrain_task, timeout=5)
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
    placement_policy: str | None = "learned",
    placement_tier: Tier | str = Tier.CPU,
    placement_options: dict[str, Any] | None = None,
    allow_active: bool = False,
    api_options: dict[str, Any] | None = None,
) -> ControlPlane:
    """Restore persisted policy/pins/model from ``state_dir``; ``mode`` (CLI) overrides the stored mode.

    ``placement_policy``: registry name of the policy object that places ``placement_tier`` (capacity from
    the policy document's tiers), fed requests inferred from KV events; None = index-only planning.
    ``placement_options``: the policy constructor's keyword arguments (the ``learned`` settings section)."""
    store = StateStore(state_dir)
    registry.register(StateStoreExporter(store))
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
        loop, store, models, api_token=api_token, tokenizer=tokenizer, engine_model=engine_model, clock=clock,
        allow_active=allow_active or mode == "active", registry=registry, **(api_options or {}),
    )  # fmt: skip
    ctx.restore()
    if mode is not None:
        loop.set_policy(loop.next_policy.model_copy(update={"mode": mode}))
    loop.commit_policy()
    if placement_policy:
        loop.placement = make_placement(loop, placement_policy, placement_tier, clock, placement_options)
    models.maybe_snapshot()
    return ControlPlane(loop, ctx, store, http)


def make_placement(
    loop: ReconcileLoop,
    name: str,
    tier: Tier | str,
    clock: Callable[[], float],
    options: dict[str, Any] | None = None,
) -> PolicyPlacement:
    """The ``--policy`` object for ``tier``, sized from the loop's policy document (0 while unmanaged)."""
    t = normalize_tier(tier) if isinstance(tier, str) else tier
    doc = loop.policy
    cap = next((c.capacity_blocks for c in doc.tiers if c.tier is t), 0)
    # the parent map of inferred requests is per block: bounded by the same block bound as the index
    inferrer = RequestInferrer(
        clock=clock,
        block_size_tokens=doc.block_size_tokens,
        max_tracked=int(loop.index.max_blocks or 1_000_000),
    )
    try:
        pl = PolicyPlacement(
            name,
            cap,
            tier=t,
            seed=doc.predictor.seed,
            inferrer=inferrer,
            options=options if name == "learned" else None,
        )
    except KeyError as exc:
        raise ValueError(f"--policy: {exc.args[0]}") from exc
    pl.lookup = loop.index.slot_of
    pl.max_slots = loop.index.max_blocks  # the one per-block bound (KVTIER_INDEX_MAX_BLOCKS)
    return pl


def create_control_app(plane: ControlPlane, registry: CollectorRegistry) -> FastAPI:
    """A standalone app (policy API, /metrics, /v1/status); the sidecar mounts the same routes on its own."""
    from prometheus_client import make_asgi_app

    from kvtier.controller.app import declare_bearer_auth, operation_id

    app = FastAPIOffline(
        title="kvtier control", version=__version__, generate_unique_id_function=operation_id
    )
    declare_bearer_auth(app)
    plane.mount(app, with_status=True)
    app.mount("/metrics", make_asgi_app(registry=registry))
    return app
