"""The one ``Collector`` interface: every signal source
(vLLM /metrics, KV events, LMCache, Mooncake, storage).

A collector splits I/O from decoding:

* :meth:`Collector.fetch` does the I/O (HTTP via a constructor-injected ``httpx.AsyncClient``, a file read, a
  socket drain) and returns the raw payload;
* :meth:`Collector.parse` is pure: raw payload (+ the injected clock's time) ->
  one typed :class:`Observation`;
* :meth:`Collector.poll` runs both, never raises, keeps :class:`HealthState` (for ``/readyz``), counts
  failures in
  ``kvtier_collector_errors_total{collector}`` and remembers the latest observation (for ``/v1/status``).

Collectors get their clock and prometheus ``CollectorRegistry`` from the constructor (never the global
registry). Metrics shared by all collectors live in :class:`CollectorMetrics`, one instance per registry.
"""

from __future__ import annotations

import logging
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any, Generic, TypeVar

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge

log = logging.getLogger(__name__)

Clock = Callable[[], float]  # returns seconds (wall clock by default: time.time)


@dataclass(frozen=True, slots=True)
class Observation:
    """Base of every typed observation. ``timestamp`` is the injected clock's time in seconds."""

    collector: str
    timestamp: float

    def to_dict(self) -> dict[str, Any]:
        """JSON-able view (dataclasses are converted recursively)."""
        return asdict(self) if is_dataclass(self) else {}


@dataclass(slots=True)
class HealthState:
    """What ``/readyz`` reports for one collector."""

    up: bool = False  # last poll succeeded
    last_success: float | None = None  # clock seconds
    last_attempt: float | None = None  # clock seconds
    last_error: str | None = None
    consecutive_failures: int = 0
    errors_by_kind: dict[str, int] = field(default_factory=dict)  # kind -> count since start

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class CollectorMetrics:
    """Prometheus metrics shared by all collectors of one registry (use :meth:`for_registry`)."""

    _by_registry: weakref.WeakKeyDictionary[CollectorRegistry, CollectorMetrics] = weakref.WeakKeyDictionary()

    def __init__(self, registry: CollectorRegistry) -> None:
        self.errors = Counter(
            "kvtier_collector_errors",
            "Collector failures and skipped bad input (fetch errors, parse errors, malformed frames).",
            ["collector"],
            registry=registry,
        )
        self.polls = Counter(
            "kvtier_collector_polls", "Collector poll attempts.", ["collector"], registry=registry
        )
        self.up = Gauge(
            "kvtier_collector_up",
            "1 if the collector's last poll succeeded, else 0.",
            ["collector"],
            registry=registry,
        )
        self.last_success = Gauge(
            "kvtier_collector_last_success_timestamp_seconds",
            "Clock time of the collector's last successful poll, seconds.",
            ["collector"],
            registry=registry,
        )

    @classmethod
    def for_registry(cls, registry: CollectorRegistry) -> CollectorMetrics:
        """The single :class:`CollectorMetrics` of ``registry`` (created on first use)."""
        m = cls._by_registry.get(registry)
        if m is None:
            m = cls(registry)
            cls._by_registry[registry] = m
        return m


RawT = TypeVar("RawT")
ObsT = TypeVar("ObsT", bound=Observation)


class Collector(ABC, Generic[RawT, ObsT]):
    """Fetch raw data (I/O), parse it (pure) into a typed observation; track health and errors.

    ``name`` is the ``collector`` label value and must be unique per registry (e.g. ``vllm:127.0.0.1:8000``).
    """

    kind: str = "collector"  # short type name for /v1/status, e.g. "vllm_metrics", "lmcache_mp"
    down_log_interval_s: float = 300.0  # reminder period of the "peer down" warning, clock seconds

    def __init__(self, name: str, *, registry: CollectorRegistry, clock: Clock = time.time) -> None:
        self.name = name
        self.registry = registry
        self.clock = clock
        self._down_logged_at: float | None = None
        self.metrics = CollectorMetrics.for_registry(registry)
        self.health = HealthState()
        self.latest: ObsT | None = None
        self.metrics.up.labels(collector=name).set(0)
        self.metrics.errors.labels(collector=name)  # export 0 before the first error

    # -- to implement -------------------------------------------------------------------------------------
    @abstractmethod
    async def fetch(self) -> RawT:
        """Do the I/O and return the raw payload. May raise; :meth:`poll` handles it."""

    @abstractmethod
    def parse(self, raw: RawT, now: float) -> ObsT:
        """Pure: raw payload observed at clock time ``now`` (seconds) -> observation. May raise ValueError."""

    # -- provided -------------------------------------------------------------------------------------------
    async def poll(self) -> ObsT | None:
        """Fetch + parse once. Never raises: failures are counted, logged and reflected in :attr:`health`."""
        now = self.clock()
        self.health.last_attempt = now
        self.metrics.polls.labels(collector=self.name).inc()
        try:
            raw = await self.fetch()
        except Exception as exc:  # noqa: BLE001 - a down peer must never stop the sidecar
            self._fail("fetch", exc)
            return None
        try:
            obs = self.parse(raw, now)
        except Exception as exc:  # noqa: BLE001
            self._fail("parse", exc)
            return None
        self.latest = obs
        self._ok(now)
        return obs

    def count_error(self, kind: str, detail: object = "", n: int = 1, *, quiet: bool = False) -> None:
        """Count ``n`` skipped bad inputs of one kind (e.g. malformed frames) with one log line (none when
        ``quiet``), without marking the collector down."""
        self.metrics.errors.labels(collector=self.name).inc(n)
        self.health.errors_by_kind[kind] = self.health.errors_by_kind.get(kind, 0) + n
        if quiet:
            return
        if n == 1:
            log.warning("%s: %s error: %s", self.name, kind, detail)
        else:
            log.warning("%s: %d %s errors: %s", self.name, n, kind, detail)

    def status(self) -> dict[str, Any]:
        """JSON-able status for ``/v1/status``: name, kind, health and the latest observation."""
        return {
            "name": self.name,
            "kind": self.kind,
            "health": self.health.to_dict(),
            "latest": self.latest.to_dict() if self.latest is not None else None,
        }

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release resources the collector owns (not injected clients)."""

    # -- internals -----------------------------------------------------------------------------------------
    def _ok(self, now: float) -> None:
        if self.health.consecutive_failures:
            log.info("%s: back up after %d failed polls", self.name, self.health.consecutive_failures)
        self._down_logged_at = None
        self.health.up = True
        self.health.last_success = now
        self.health.last_error = None
        self.health.consecutive_failures = 0
        self.metrics.up.labels(collector=self.name).set(1)
        self.metrics.last_success.labels(collector=self.name).set(now)

    def _fail(self, kind: str, exc: BaseException) -> None:
        self.health.up = False
        self.health.consecutive_failures += 1
        self.health.last_error = f"{kind}: {type(exc).__name__}: {exc}"
        self.metrics.up.labels(collector=self.name).set(0)
        self.count_error(kind, self.health.last_error, quiet=True)
        # one warning when the peer goes down, then a reminder every down_log_interval_s (not every poll:
        # an engine that is away for a day would write tens of thousands of identical lines)
        now = self.clock()
        last = self._down_logged_at
        if last is None or now - last >= self.down_log_interval_s:
            self._down_logged_at = now
            log.warning(
                "%s: down, %d failed polls so far (next reminder in %.0f s unless it recovers): %s",
                self.name, self.health.consecutive_failures, self.down_log_interval_s, self.health.last_error,
            )  # fmt: skip


class HttpPeerCollector(Collector[RawT, ObsT]):
    """A collector of one HTTP peer at ``base_url``, with an injected ``httpx.AsyncClient``.

    Subclasses implement :meth:`fetch` with :meth:`get` (one or several endpoints) and :meth:`parse`.
    """

    def __init__(
        self,
        name: str,
        base_url: str,
        *,
        client: httpx.AsyncClient,
        registry: CollectorRegistry,
        clock: Clock = time.time,
        timeout_s: float = 5.0,
    ) -> None:
        super().__init__(name, registry=registry, clock=clock)
        self.base_url = base_url.rstrip("/")
        self.client = client
        self.timeout_s = timeout_s

    async def get(self, path: str) -> httpx.Response:
        """GET ``base_url + path`` (one retry on a stale pooled connection); raises on status >= 400."""
        try:
            resp = await self.client.get(self.base_url + path, timeout=self.timeout_s)
        except (httpx.RemoteProtocolError, httpx.ReadError):
            resp = await self.client.get(self.base_url + path, timeout=self.timeout_s)
        resp.raise_for_status()
        return resp

    def status(self) -> dict[str, Any]:
        out = super().status()
        out["url"] = self.base_url
        return out


class HttpCollector(HttpPeerCollector[str, ObsT]):
    """An :class:`HttpPeerCollector` whose raw input is the text of ``GET base_url + path``.

    Subclasses set :attr:`path` and implement :meth:`parse`.
    """

    path: str = "/metrics"

    async def fetch(self) -> str:
        resp = await self.get(self.path)
        return resp.text
