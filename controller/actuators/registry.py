"""Every actuator by name (``kvtier serve --actuator NAME``, the ``actuators`` settings ``kind``):
``shadow``, ``vllm-warmup``, ``lmcache-mp``, ``lmcache-controller``, ``mooncake``, ``memory`` (the
simulator's layer).

Each entry is a factory taking keyword arguments, plus the wiring value it may take from the sidecar when
the options do not set it (:data:`WIRING`: ``url`` from the first ``--lmcache-url``, the engine's URL and
model for ``vllm-warmup``).

The settings' actuator union (:data:`kvtier.controller.settings.ActuatorSettings`) has one more kind,
``lmcache-l1``: the LMCache L1 keeper acts beside the reconcile loop rather than for the planner, so it is no
:class:`Actuator`; ``root.build_keeper`` builds it on its own ``lmcache-mp`` adapter."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .base import Actuator
from .resilience import HttpCaller

Factory = Callable[..., Actuator]
_FACTORIES: dict[str, Factory] = {}


def register(name: str, factory: Factory) -> None:
    _FACTORIES[name] = factory


def names() -> list[str]:
    return sorted(_FACTORIES)


def build(name: str, **settings: Any) -> Actuator:
    """Construct actuator ``name``; settings are the factory's keyword arguments (see each factory)."""
    try:
        factory = _FACTORIES[name]
    except KeyError:
        raise ValueError(f"unknown actuator {name!r}; known: {names()}") from None
    return factory(**settings)


def _shadow() -> Actuator:
    from .shadow import ShadowActuator

    return ShadowActuator()


def _vllm_warmup(*, engine_url: str, engine_model: str, **kw: Any) -> Actuator:
    """``engine_url``/``engine_model``: the vLLM server warmed (defaults: the first ``--engine-url`` and its
    served model); other keywords go to :class:`VllmWarmupActuator` (``budget``, ``timeout_s``)."""
    from .vllm_warmup import VllmWarmupActuator

    return VllmWarmupActuator(engine_url, engine_model, **kw)


def _lmcache_mp(
    *,
    url: str,
    timeout_s: float = 5.0,
    retries: int = 3,
    breaker_failures: int = 3,
    breaker_reset_s: float = 5.0,
    **kw: Any,
) -> Actuator:
    """``url``: the MP server's HTTP address (``--http-host/--http-port``). ``retries``: attempts per
    request; the circuit breaker opens after ``breaker_failures`` consecutive failures and lets a trial call
    through after ``breaker_reset_s`` seconds. Other keywords go to :class:`LMCacheMPActuator`
    (e.g. ``model_name``, ``prefetch_timeout_s``)."""
    from .lmcache_mp import LMCacheMPActuator
    from .resilience import CircuitBreaker, Resilient, RetryPolicy

    if retries < 1 or breaker_failures < 1 or breaker_reset_s < 0 or timeout_s <= 0:
        raise ValueError(
            "lmcache-mp: need retries >= 1, breaker_failures >= 1, breaker_reset_s >= 0, "
            f"timeout_s > 0 (got {retries}, {breaker_failures}, {breaker_reset_s}, {timeout_s})"
        )
    resilient = Resilient(
        RetryPolicy(max_attempts=retries),
        CircuitBreaker(failure_threshold=breaker_failures, reset_timeout_s=breaker_reset_s),
    )
    return LMCacheMPActuator(HttpCaller(url, timeout_s=timeout_s, resilient=resilient), **kw)


def _lmcache_controller(*, url: str, instance_id: str, timeout_s: float = 10.0) -> Actuator:
    from .lmcache_controller import build as build_controller

    return build_controller(url, instance_id, timeout_s=timeout_s)


def _mooncake(
    *,
    admin_url: str,
    local_hostname: str,
    metadata_url: str,
    master_addr: str,
    segment_bytes: int = 64 << 20,
    buffer_bytes: int = 16 << 20,
    protocol: str = "tcp",
    timeout_s: float = 5.0,
) -> Actuator:
    """Sets up a Mooncake client (needs the ``mooncake-transfer-engine`` wheel in this interpreter)."""
    import importlib

    from .mooncake import MooncakeActuator

    mc = importlib.import_module("mooncake.store")
    store = mc.MooncakeDistributedStore()
    rc = store.setup(local_hostname, metadata_url, segment_bytes, buffer_bytes, protocol, "", master_addr)
    if rc != 0:
        raise RuntimeError(f"mooncake setup({local_hostname}) returned {rc}")
    return MooncakeActuator(store, HttpCaller(admin_url, timeout_s=timeout_s), bindings=mc)


def _memory(**kw: Any) -> Actuator:
    """The simulator's cache layer (``kvtier demo``): ``layer`` is a ``kvtier.replay.sim`` CacheLayer."""
    from kvtier.replay.sim.actuator import build as build_memory

    return build_memory(**kw)


# name -> {factory keyword: (sidecar wiring value, the flag that sets it)} filled in unless the options set it
WIRING: dict[str, dict[str, tuple[str, str]]] = {
    "vllm-warmup": {"engine_url": ("engine_url", "--engine-url"), "engine_model": ("engine_model", "")},
    "lmcache-mp": {"url": ("lmcache_url", "--lmcache-url")},
    "lmcache-controller": {"url": ("lmcache_controller_url", "--lmcache-controller-url")},
}

register("shadow", _shadow)
register("vllm-warmup", _vllm_warmup)
register("lmcache-mp", _lmcache_mp)
register("lmcache-controller", _lmcache_controller)
register("mooncake", _mooncake)
register("memory", _memory)
