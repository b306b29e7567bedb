"""Retry/backoff/jitter and circuit breaker, with an injected clock, sleeper and RNG (no real sleeps).

The HTTP cases talk to httpx.MockTransport: this tests the retry logic only; the real-server
behaviour (LMCache killed mid-run) is in test_lmcache_mp_live.py.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import httpx
import pytest

from kvtier.controller.actuators.resilience import (
    CircuitBreaker,
    CircuitOpen,
    HttpCaller,
    Resilient,
    RetryPolicy,
    TransientError,
)


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.t += s


def test_backoff_is_exponential_capped_and_jittered_within_bounds() -> None:
    p = RetryPolicy(max_attempts=6, base_delay_s=0.1, max_delay_s=0.5, jitter=0.5)
    rng = random.Random(7)
    delays = [p.delay(n, rng) for n in range(1, 6)]
    caps = [0.1, 0.2, 0.4, 0.5, 0.5]
    for d, c in zip(delays, caps, strict=True):
        assert c * 0.5 <= d <= c
    # jitter actually varies the delay
    assert len({round(p.delay(3, rng), 9) for _ in range(5)}) > 1
    assert RetryPolicy(jitter=0.0).delay(2, rng) == pytest.approx(0.2)


def test_retries_transient_then_succeeds_and_sleeps_backoff() -> None:
    clk = FakeClock()
    calls = {"n": 0}

    def flaky() -> str:
        calls["n"] += 1
        if calls["n"] < 3:
            raise TransientError("boom")
        return "ok"

    r = Resilient(
        RetryPolicy(max_attempts=3, base_delay_s=0.1, jitter=0.0),
        CircuitBreaker(failure_threshold=5, clock=clk),
        sleep=clk.sleep,
        rng=random.Random(0),
    )
    assert r.call(flaky) == ("ok", 3)
    assert clk.sleeps == [pytest.approx(0.1), pytest.approx(0.2)]
    assert r.breaker.state == "closed" and r.breaker.consecutive_failures == 0


def test_non_transient_errors_propagate_without_retry() -> None:
    clk = FakeClock()
    r = Resilient(RetryPolicy(max_attempts=3), CircuitBreaker(clock=clk), sleep=clk.sleep)

    def bad() -> None:
        raise ValueError("bad input")

    with pytest.raises(ValueError):
        r.call(bad)
    assert r.attempts_total == 1 and clk.sleeps == [] and r.breaker.consecutive_failures == 0


def test_breaker_opens_fails_fast_half_opens_and_recovers() -> None:
    clk = FakeClock()
    br = CircuitBreaker(failure_threshold=3, reset_timeout_s=5.0, clock=clk)
    r = Resilient(RetryPolicy(max_attempts=3, base_delay_s=0.1), br, sleep=clk.sleep)
    up = {"v": False}
    calls = {"n": 0}

    def peer() -> str:
        calls["n"] += 1
        if not up["v"]:
            raise TransientError("connection refused")
        return "pong"

    with pytest.raises(TransientError):
        r.call(peer)
    assert br.state == "open" and calls["n"] == 3 and br.opened_total == 1
    with pytest.raises(CircuitOpen):
        r.call(peer)
    assert calls["n"] == 3  # failed fast, peer not called
    clk.t += 5.0
    assert br.state == "half_open"
    with pytest.raises(CircuitOpen):  # trial fails -> re-opened at once, no further attempt
        r.call(peer)
    assert calls["n"] == 4 and br.state == "open" and br.opened_total == 2
    clk.t += 5.0
    up["v"] = True
    assert r.call(peer) == ("pong", 1)
    assert br.state == "closed"


def test_half_open_lets_one_trial_through() -> None:
    clk = FakeClock()
    br = CircuitBreaker(failure_threshold=1, reset_timeout_s=1.0, clock=clk)
    br.record_failure("x")
    clk.t += 1.0
    assert br.allow() is True
    assert br.allow() is False  # second concurrent caller blocked while the trial is in flight
    br.record_success()
    assert br.allow() is True


def test_http_caller_retries_5xx_and_transport_errors_not_4xx_or_503() -> None:
    clk = FakeClock()
    seq: Iterator[Exception | int] = iter([httpx.ConnectError("refused"), 502, 200])
    seen: list[str] = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(req.url.path)
        nxt = next(seq)
        if isinstance(nxt, Exception):
            raise nxt
        return httpx.Response(nxt, json={"ok": nxt == 200})

    res = Resilient(
        RetryPolicy(max_attempts=3, base_delay_s=0.01), CircuitBreaker(clock=clk), sleep=clk.sleep
    )
    c = HttpCaller("http://peer", client=httpx.Client(transport=httpx.MockTransport(handler)), resilient=res)
    reply, attempts = c.request("GET", "/x")
    assert (reply.status, reply.body, attempts) == (200, {"ok": True}, 3)

    for code in (404, 503):
        hits: list[str] = []

        def refuse(r: httpx.Request, code: int = code, hits: list[str] = hits) -> httpx.Response:
            hits.append(r.url.path)
            return httpx.Response(code, json={"detail": "no"})

        c2 = HttpCaller(
            "http://peer", resilient=res, client=httpx.Client(transport=httpx.MockTransport(refuse))
        )
        reply, attempts = c2.request("DELETE", "/y")
        assert (reply.status, attempts) == (code, 1)
        assert hits == ["/y"]  # sent exactly once: 4xx and 503 are answers, not retried
