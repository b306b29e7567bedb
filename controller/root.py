"""The composition root: every part of the sidecar is built here, and only here.

:func:`build_sidecar` turns :class:`Settings` (plus injectable clock, prometheus registry, HTTP client, block
ingestor, extra actuators and a seed policy document) into a :class:`~kvtier.controller.sidecar.Sidecar`;
:func:`kvtier.controller.app.create_app` serves it. ``kvtier serve``, ``kvtier demo``, the tests and the
benches all go through these two functions, so the tests run the composition production runs.
:func:`build_loop` builds a bare :class:`ReconcileLoop` (no API, no collectors) for shadow replay and the
tick bench.

Nothing built here touches the network: the one blocking look-up, the served model's name
(``GET /v1/models``), is the explicit start-up step :func:`discover_models`, run before :func:`build_sidecar`;
the engine's cache geometry is discovered asynchronously by :meth:`Sidecar.start`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import httpx
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

from kvtier.collectors.base import Clock
from kvtier.collectors.kv_ingest import KvIngestor
from kvtier.collectors.kv_requests import RequestInferrer
from kvtier.controller.actuators.base import Actuator
from kvtier.controller.api import ControlContext, engine_tokenizer
from kvtier.controller.build_info import register_build_info
from kvtier.controller.collection import CollectorSet
from kvtier.controller.decisions import DecisionLog
from kvtier.controller.l1_keeper import EngineTtftReader, L1Keeper, keeper_hook
from kvtier.controller.loop import ReconcileLoop
from kvtier.controller.metrics import ControllerMetrics
from kvtier.controller.model import ModelManager
from kvtier.controller.pins import PinSet
from kvtier.controller.placement import PolicyPlacement
from kvtier.controller.plane import ControlPlane, ControlSink
from kvtier.controller.policy_doc import PolicyDoc
from kvtier.controller.settings import LMCacheL1Settings, LMCacheMPSettings, Settings, VllmWarmupSettings
from kvtier.controller.sidecar import Sidecar
from kvtier.controller.store import StateStore, StateStoreExporter
from kvtier.controller.tokens import TokenStore
from kvtier.controller.tracing import instrument_http, make_tracer, make_tracer_provider
from kvtier.policies.index import BlockIndex
from kvtier.policies.tiers import Tier, normalize_tier

log = logging.getLogger(__name__)


def build_sidecar(
    settings: Settings,
    *,
    clock: Clock = time.time,
    registry: CollectorRegistry | None = None,
    http: httpx.AsyncClient | None = None,
    ingestor: KvIngestor | None = None,
    actuators: Sequence[Actuator] = (),
    policy: PolicyDoc | None = None,
    tracer_provider: TracerProvider | None = None,
    reset_state: bool = False,
    emulated_engine: bool = False,
) -> Sidecar:
    """The sidecar of ``settings``: collectors, block index, reconcile loop, state store, policy API context,
    the settings' actuators and the L1 keeper, wired together; nothing runs until :meth:`Sidecar.start`.

    Injectable (production passes none of them): ``clock`` (seconds; the demo's simulated time), ``registry``
    (a fresh one otherwise), ``http`` (the shared client, owned by the caller when given), ``ingestor`` (the
    demo's index-counting one), ``actuators`` (built actuator objects, appended after the settings' entries),
    ``policy`` (the seed document instead of the settings' planner/loop/predictor sections; a document
    persisted in the state dir still wins), ``tracer_provider`` (an in-memory exporter in tests).
    ``reset_state``: ``--reset-state``, forget the persisted policy first. ``emulated_engine``: the index and
    the reconcile loop are driven by a simulation, so readiness needs no engine URL and :meth:`Sidecar.start`
    leaves the loop to it. The served model's name comes from
    ``settings.collectors.engine_model`` (fill it with :func:`discover_models`)."""
    if reset_state:
        reset_persisted_policy(settings.serve.state_dir)
    col = settings.collectors
    registry = registry if registry is not None else CollectorRegistry()
    register_build_info(registry)
    owns_http = http is None
    http = http if http is not None else httpx.AsyncClient(timeout=col.http_timeout_s)
    ingestor = ingestor or KvIngestor(BlockIndex(max_blocks=col.index_max_blocks))
    collectors = CollectorSet(settings, registry=registry, client=http, clock=clock, ingestor=ingestor,
                              emulated_engine=emulated_engine)  # fmt: skip
    engine_url = col.engine_urls[0] if col.engine_urls else None
    model = col.engine_model
    acts, keeper_spec = settings_actuators(settings, engine_url, model)
    acts += list(actuators)
    if tracer_provider is None:
        tracer_provider = make_tracer_provider()
    instrument_http(tracer_provider)  # actuations' peer calls become child spans
    doc = policy if policy is not None else PolicyDoc.model_validate(settings.policy_doc_seed())
    plane = build_control_plane(
        ingestor.index, settings, registry=registry, actuators=acts, tracer=make_tracer(tracer_provider),
        clock=clock, engine_url=engine_url, engine_model=model, http=http, policy=doc,
        plans=bool(acts) or keeper_spec is None,  # the keeper alone decides: the loop observes only
    )  # fmt: skip
    keeper = (
        build_keeper(settings, keeper_spec, plane, registry, engine_url) if keeper_spec is not None else None
    )
    ingestor.sinks.append(ControlSink(plane, on_stored=keeper_hook(keeper) if keeper is not None else None))
    return Sidecar(settings, collectors=collectors, plane=plane, l1_keeper=keeper, http=http,
                   owns_http=owns_http, tracer_provider=tracer_provider, engine_url=engine_url,
                   runs_plane=not emulated_engine)  # fmt: skip


def settings_actuators(
    settings: Settings, engine_url: str | None, model: str
) -> tuple[list[Actuator], LMCacheL1Settings | None]:
    """The planner actuators of ``settings.actuators`` (built, not connected) and the ``lmcache-l1`` keeper's
    entry, if any (it acts on LMCache L1 by itself: not a planner actuator)."""
    col = settings.collectors
    acts: list[Actuator] = []
    keeper: LMCacheL1Settings | None = None
    for spec in settings.actuators:
        if isinstance(spec, LMCacheL1Settings):
            keeper = spec
            continue
        extra: dict[str, Any] = {}
        # the entry's fields as the factory's keywords (as objects: ``memory`` carries a live layer)
        options = {k: v for k, v in spec if k != "kind" and v is not None}
        if isinstance(spec, VllmWarmupSettings):
            from kvtier.controller.actuators.vllm_warmup import WarmupBudget

            extra["budget"] = WarmupBudget(options.pop("tokens_per_s"), options.pop("requests_per_s"))
        if isinstance(spec, LMCacheMPSettings) and "model_name" not in options and engine_url:
            options["model_name"] = model  # discover_models fills in vLLM's --model path when it can
        acts.append(make_actuator(spec.kind, engine_url=engine_url, engine_model=model,
                                  lmcache_url=col.lmcache_urls[0] if col.lmcache_urls else None,
                                  lmcache_controller_url=col.lmcache_controller_urls[0]
                                  if col.lmcache_controller_urls else None,
                                  options=options, **extra))  # fmt: skip
    return acts, keeper


def build_control_plane(
    index: BlockIndex,
    settings: Settings,
    *,
    registry: CollectorRegistry,
    actuators: Sequence[Actuator],
    tracer: Any,
    clock: Clock,
    engine_url: str | None,
    engine_model: str,
    http: httpx.AsyncClient,
    policy: PolicyDoc,
    plans: bool = True,
) -> ControlPlane:
    """Loop + state store + models + API context; restores the persisted policy, pins and model from the
    state dir, then ``settings.serve.mode`` (CLI) overrides the stored mode. The placement policy object
    (``settings.loop.policy``, ``none`` = index-only planning) is sized from the restored document."""
    sv, lp = settings.serve, settings.loop
    store = StateStore(sv.state_dir)
    registry.register(StateStoreExporter(store))
    metrics = ControllerMetrics(registry, layers=[a.name for a in actuators])
    loop = build_loop(index, policy=policy, actuators=actuators, pins=PinSet(), tokens=TokenStore(),
                      decisions=DecisionLog(), metrics=metrics, tracer=tracer, clock=clock,
                      model=engine_model, plans=plans)  # fmt: skip
    models = ModelManager(loop, store)
    tokenizer = engine_tokenizer(engine_url, http) if engine_url else None
    ctx = ControlContext(
        loop, store, models, api_token=sv.api_token, tokenizer=tokenizer, engine_model=engine_model,
        clock=clock, allow_active=sv.allow_active or sv.mode == "active", registry=registry,
        **api_options(settings),
    )  # fmt: skip
    ctx.restore()
    if sv.mode is not None:
        loop.set_policy(loop.next_policy.model_copy(update={"mode": sv.mode}))
    loop.commit_policy()
    if lp.policy != "none":
        loop.placement = make_placement(loop, lp.policy, lp.policy_tier, clock, settings.learned.options())
    models.maybe_snapshot()
    return ControlPlane(loop, ctx, store)


def build_loop(
    index: BlockIndex,
    *,
    policy: PolicyDoc,
    metrics: ControllerMetrics,
    clock: Callable[[], float] = time.time,
    placement_policy: str | None = None,
    placement_tier: Tier | str = Tier.CPU,
    **loop_kw: Any,
) -> ReconcileLoop:
    """A :class:`ReconcileLoop` over ``index`` (``loop_kw``: its other constructor keywords; ``clock`` in
    seconds); ``placement_policy``: the registry name of the policy object placing ``placement_tier``."""
    loop = ReconcileLoop(index, policy=policy, metrics=metrics, clock=clock, **loop_kw)
    if placement_policy:
        loop.placement = make_placement(loop, placement_policy, placement_tier, clock)
    return loop


def make_placement(
    loop: ReconcileLoop,
    name: str,
    tier: Tier | str,
    clock: Callable[[], float],
    options: dict[str, Any] | None = None,
) -> PolicyPlacement:
    """The ``--policy`` object for ``tier``, sized from the loop's policy document (0 while unmanaged).
    ``options``: the ``learned`` policy's constructor keywords (the ``learned`` settings section)."""
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


def build_keeper(
    settings: Settings,
    spec: LMCacheL1Settings,
    plane: ControlPlane,
    registry: CollectorRegistry,
    engine_url: str | None = None,
) -> L1Keeper:
    """``--actuator lmcache-l1``: the LMCache MP L1 keeper (:mod:`kvtier.controller.l1_keeper`), acting
    through its own lmcache-mp adapter on the first ``--lmcache-url``. Fed through :func:`keeper_hook`.
    With ``latency_guard`` on it reads the first engine's TTFT histogram (``engine_url``)."""
    from kvtier.controller.actuators import lmcache_mp

    urls = settings.collectors.lmcache_urls
    if not urls:
        raise ValueError("--actuator lmcache-l1 needs --lmcache-url")
    act = lmcache_mp.build(urls[0], model_name=spec.model_name or "")
    acts = plane.loop.metrics.actuations
    loop = plane.loop

    def record(what: str, n: int) -> None:  # "action:outcome"
        action, _, outcome = what.partition(":")
        acts.labels(layer="lmcache-mp", action=action, outcome=outcome).inc(n)

    ttft = None
    if spec.latency_guard:
        if not engine_url:
            raise ValueError("actuator 'lmcache-l1': latency_guard needs an engine URL (--engine-url)")
        ttft = EngineTtftReader(engine_url, settings.collectors.http_timeout_s)
    return L1Keeper(act, chain_tokens=loop.tokens.chain_tokens, is_active=lambda: loop.mode == "active",
                    registry=registry, record=record, engine_ttft=ttft, **spec.keeper_options())  # fmt: skip


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


def reset_persisted_policy(state_dir: str) -> bool:
    """``--reset-state``: forget the policy persisted by the API (pins and trained models are kept)."""
    store = StateStore(state_dir)
    try:
        dropped = store.delete_key("policy")
    finally:
        store.close()
    if dropped:
        log.warning("--reset-state: dropped the policy persisted in %s", state_dir)
    return dropped


def discover_models(settings: Settings, timeout_s: float = 5.0) -> Settings:
    """The start-up step before :func:`build_sidecar` (blocking HTTP, once): ``settings`` with the names the
    first engine serves filled in where unset -- ``collectors.engine_model`` from ``GET /v1/models``' ``id``
    (the served name), and the ``model_name`` of ``lmcache-mp``/``lmcache-l1`` actuator entries from its
    ``root`` (vLLM's ``--model`` path, which LMCache keys use). Unchanged without an engine URL."""
    col = settings.collectors
    if not col.engine_urls:
        return settings
    url = col.engine_urls[0]
    named = (LMCacheMPSettings, LMCacheL1Settings)
    wants_root = any(isinstance(a, named) and a.model_name is None for a in settings.actuators)
    if col.engine_model and not wants_root:
        return settings
    served, root = served_model(url, timeout_s)
    model = col.engine_model or served
    acts = []
    for a in settings.actuators:
        if isinstance(a, LMCacheMPSettings) and a.model_name is None:
            a = a.model_copy(update={"model_name": root or model})
        elif isinstance(a, LMCacheL1Settings) and a.model_name is None:
            a = a.model_copy(update={"model_name": root})
        acts.append(a)
    return settings.model_copy(
        update={"collectors": col.model_copy(update={"engine_model": model}), "actuators": acts}
    )


def served_model(engine_url: str, timeout_s: float = 5.0) -> tuple[str, str]:
    """The first model of a vLLM server (``GET /v1/models``): (served name ``id``, ``--model`` path
    ``root``); ("", "") when unreachable (logged)."""
    try:
        r = httpx.get(engine_url.rstrip("/") + "/v1/models", timeout=timeout_s)
        r.raise_for_status()
        m = r.json()["data"][0]
        return str(m["id"]), str(m.get("root") or "")
    except (httpx.HTTPError, KeyError, IndexError, ValueError, TypeError) as exc:
        log.warning(
            "could not discover the served model of %s (%s); set KVTIER_ENGINE_MODEL", engine_url, exc
        )
        return "", ""
