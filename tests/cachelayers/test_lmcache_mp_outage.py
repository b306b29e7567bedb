"""Killing the REAL LMCache MP server mid-run: the adapter's per-key outcomes fail, the circuit breaker opens
and then fails fast without contacting the server, the collector reports it down; when the server returns
(same ports, same fs L2 directory) the breaker half-opens after its reset timeout and the adapter recovers.
The breaker's clock is injected (advanced by hand) and retry sleeps are no-ops, so no test time is spent
waiting on timers; the server restart itself is awaited by polling its health check."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry

from kvtier.collectors.lmcache_mp import LMCacheMPCollector
from kvtier.controller.actuators.base import BlockRef, Outcome
from kvtier.controller.actuators.lmcache_mp import LMCacheMPActuator
from kvtier.controller.actuators.resilience import CircuitBreaker, HttpCaller, Resilient, RetryPolicy
from kvtier.policies.tiers import Tier
from tests.peers.lmcache import FakeEngine, LMCacheMPServer

pytestmark = pytest.mark.lmcache


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[LMCacheMPServer, FakeEngine]]:
    s = LMCacheMPServer(tmp_path / "mp")
    e = FakeEngine(s, seed=5)
    try:
        s.start()
        e.start()
        yield s, e
    finally:
        e.stop()
        s.stop()


def test_outage_opens_the_breaker_and_recovery_closes_it(server: tuple[LMCacheMPServer, FakeEngine]) -> None:
    s, engine = server
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=3, reset_timeout_s=30.0, clock=clock)
    resilient = Resilient(RetryPolicy(max_attempts=2, base_delay_s=0.05), breaker, sleep=lambda _s: None)
    act = LMCacheMPActuator(HttpCaller(s.url, timeout_s=2.0, resilient=resilient), clock=clock)
    loop = asyncio.new_event_loop()
    coll = LMCacheMPCollector(
        "lmcache_mp:outage", s.url, client=httpx.AsyncClient(), registry=CollectorRegistry()
    )
    ref = BlockRef(model="tiny", token_ids=tuple(engine.token_ids))

    assert act.demote([ref], Tier.DISK).count(Outcome.APPLIED) == 4  # healthy: L1 -> L2 only
    assert loop.run_until_complete(coll.poll()) is not None and coll.health.up

    s.stop()  # the server dies mid-run
    r1 = act.promote([ref], Tier.CPU)
    assert r1.count(Outcome.FAILED) == 4 and all("unreachable" in o.detail for o in r1.outcomes)
    assert r1.attempts == 2 and breaker.state == "closed"
    r2 = act.promote([ref], Tier.CPU)
    assert r2.count(Outcome.FAILED) == 4 and breaker.state == "open"
    r3 = act.promote([ref], Tier.CPU)
    assert r3.attempts == 0 and all("circuit open" in o.detail for o in r3.outcomes)
    assert act.health().breaker == "open"
    assert loop.run_until_complete(coll.poll()) is None and not coll.health.up
    assert coll.health.consecutive_failures == 1

    s.start()  # back on the same ports with the same L2 directory
    r4 = act.evict([ref], Tier.DISK)
    assert r4.attempts == 0 and breaker.state == "open"  # still failing fast until the reset timeout
    clock.t += 30.0
    assert breaker.state == "half_open"
    r5 = act.evict([ref], Tier.DISK)  # the trial call reaches the restarted server
    assert r5.ok and r5.attempts == 4, r5
    assert breaker.state == "closed" and act.health().consecutive_failures == 0
    assert loop.run_until_complete(coll.poll()) is not None and coll.health.up
    loop.run_until_complete(coll.client.aclose())
    loop.close()
