"""Retries with exponential backoff + jitter, a circuit breaker, and an HTTP caller using both.

Clock, sleeper and RNG are injected so tests run without real sleeps. Times are seconds.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx

T = TypeVar("T")
Clock = Callable[[], float]
Sleeper = Callable[[float], None]


class CircuitOpen(Exception):
    """Raised instead of calling the peer while the breaker is open."""


class TransientError(Exception):
    """A failure worth retrying (peer unreachable, timeout, 5xx other than a definite refusal)."""


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """``max_attempts`` tries in all; delay before retry n (1-based) is
    ``min(max_delay_s, base_delay_s * 2**(n-1))`` scaled by a jitter factor in ``[1-jitter, 1]``."""

    max_attempts: int = 3
    base_delay_s: float = 0.1
    max_delay_s: float = 2.0
    jitter: float = 0.5

    def delay(self, retry: int, rng: random.Random) -> float:
        raw = min(self.max_delay_s, self.base_delay_s * (2 ** (retry - 1)))
        return raw * (1.0 - self.jitter * rng.random())


class CircuitBreaker:
    """closed -> open after ``failure_threshold`` consecutive failures; open -> half_open after
    ``reset_timeout_s``; one trial call in half_open closes it on success or re-opens it on failure."""

    def __init__(
        self, failure_threshold: int = 3, reset_timeout_s: float = 5.0, clock: Clock = time.monotonic
    ) -> None:
        self.failure_threshold = failure_threshold
        self.reset_timeout_s = reset_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0
        self._opened_at: float | None = None
        self._trial_in_flight = False
        self.last_error = ""
        self.opened_total = 0

    @property
    def consecutive_failures(self) -> int:
        return self._failures

    @property
    def state(self) -> str:
        with self._lock:
            return self._state_locked()

    def _state_locked(self) -> str:
        if self._opened_at is None:
            return "closed"
        if self._clock() - self._opened_at >= self.reset_timeout_s:
            return "half_open"
        return "open"

    def allow(self) -> bool:
        """May a call go out now? In half_open only one trial call at a time is let through."""
        with self._lock:
            st = self._state_locked()
            if st == "closed":
                return True
            if st == "half_open" and not self._trial_in_flight:
                self._trial_in_flight = True
                return True
            return False

    def record_success(self) -> None:
        with self._lock:
            self._failures = 0
            self._opened_at = None
            self._trial_in_flight = False

    def record_failure(self, error: str = "") -> None:
        with self._lock:
            self._failures += 1
            self.last_error = error
            half_open = self._opened_at is not None
            if half_open or self._failures >= self.failure_threshold:
                if self._opened_at is None or half_open:
                    self.opened_total += 1
                self._opened_at = self._clock()
            self._trial_in_flight = False


class Resilient:
    """Runs a callable under a retry policy and a circuit breaker.

    The callable raises :class:`TransientError` (or ``httpx.TransportError``) for retryable failures;
    anything else propagates at once and does not count against the breaker.
    """

    def __init__(
        self,
        retry: RetryPolicy | None = None,
        breaker: CircuitBreaker | None = None,
        sleep: Sleeper = time.sleep,
        rng: random.Random | None = None,
    ) -> None:
        self.retry = retry or RetryPolicy()
        self.breaker = breaker or CircuitBreaker()
        self._sleep = sleep
        self._rng = rng or random.Random(0)
        self.attempts_total = 0

    def call(self, fn: Callable[[], T]) -> tuple[T, int]:
        """Return ``(result, attempts)``. Raises CircuitOpen, or the last TransientError."""
        last: Exception | None = None
        for attempt in range(1, self.retry.max_attempts + 1):
            if not self.breaker.allow():
                raise CircuitOpen(f"circuit open (last error: {self.breaker.last_error})")
            self.attempts_total += 1
            try:
                out = fn()
            except (TransientError, httpx.TransportError) as e:
                last = e
                self.breaker.record_failure(f"{type(e).__name__}: {e}")
                if attempt < self.retry.max_attempts:
                    self._sleep(self.retry.delay(attempt, self._rng))
                continue
            self.breaker.record_success()
            return out, attempt
        assert last is not None
        if isinstance(last, TransientError):
            raise last
        raise TransientError(f"{type(last).__name__}: {last}") from last


@dataclass(frozen=True, slots=True)
class HttpReply:
    status: int
    body: Any  # parsed JSON, or the text when not JSON


class HttpCaller:
    """JSON-over-HTTP with :class:`Resilient`. 5xx other than 501/503 and transport errors are
    transient; 501/503 (a live server that refuses) and 4xx are returned to the caller."""

    def __init__(
        self,
        base_url: str,
        *,
        client: httpx.Client | None = None,
        timeout_s: float = 5.0,
        resilient: Resilient | None = None,
        retry_status: frozenset[int] = frozenset({500, 502, 504}),
    ) -> None:
        self.retry_status = retry_status
        self.base_url = base_url.rstrip("/")
        self._client = client or httpx.Client(timeout=timeout_s)
        self.resilient = resilient or Resilient()

    def request(self, method: str, path: str, json: Any = None) -> tuple[HttpReply, int]:
        def once() -> HttpReply:
            r = self._client.request(method, self.base_url + path, json=json)
            if r.status_code in self.retry_status:
                raise TransientError(f"HTTP {r.status_code} {method} {path}: {r.text[:200]}")
            try:
                body: Any = r.json()
            except ValueError:
                body = r.text
            return HttpReply(r.status_code, body)

        return self.resilient.call(once)

    def close(self) -> None:
        self._client.close()
