"""An (emulated) pin to ``cpu`` on the REAL LMCache MP server keeps a prefix in L1 under pressure: a tiny
L1 (5 MB = 81 chunks) is flooded with 30 other sequences (4 chunks each, one every 0.25 s) by LMCache's own
worker adapter. The sequence stored at the same time as the pinned one is evicted from L1; the pinned one
was evicted too (its refresh reloads 4 chunks from L2) and is back in L1 after the loop's
``refresh_pins()``. L1 residency is read destructively at the end (``DELETE`` tier l1 per key)."""

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
from kvtier.controller.actuators.resilience import HttpCaller
from kvtier.policies.tiers import Tier
from tests.peers.lmcache import FakeEngine, LMCacheMPServer

pytestmark = pytest.mark.lmcache


@pytest.fixture
def small_l1(tmp_path: Path) -> Iterator[tuple[LMCacheMPServer, FakeEngine]]:
    s = LMCacheMPServer(tmp_path / "mp", l1_gb=0.005)
    e = FakeEngine(s, seed=100, sequences=2)
    try:
        s.start()
        e.start()
        yield s, e
    finally:
        e.stop()
        s.stop()


def test_pinned_prefix_stays_in_l1_under_pressure(small_l1: tuple[LMCacheMPServer, FakeEngine]) -> None:
    s, engine = small_l1
    p_toks, q_toks = engine.all_token_ids
    act = LMCacheMPActuator(HttpCaller(s.url, timeout_s=10.0))
    pinned = BlockRef(model="tiny", token_ids=tuple(p_toks))
    other = BlockRef(model="tiny", token_ids=tuple(q_toks))
    assert act.pin([pinned], Tier.CPU).count(Outcome.APPLIED) == 4
    assert [b.token_ids for b in act.pinned()] == [pinned.token_ids]

    loop = asyncio.new_event_loop()
    coll = LMCacheMPCollector(
        "lmcache_mp:pin", s.url, client=httpx.AsyncClient(), registry=CollectorRegistry()
    )
    before = loop.run_until_complete(coll.poll())
    assert before is not None
    flood = FakeEngine(s, seed=200, sequences=30, pace_s=0.25)
    try:
        flood.start()
    finally:
        flood.stop()
    after = loop.run_until_complete(coll.poll())
    assert after is not None
    evicted = after.counters["l1_evicted_chunks"] - before.counters["l1_evicted_chunks"]
    assert evicted >= 40, f"no L1 pressure: {evicted} chunks evicted"

    refresh = act.refresh_pins()
    assert refresh.count(Outcome.APPLIED) == 4, refresh
    reloaded = loop.run_until_complete(coll.poll())
    assert reloaded is not None
    loads = {
        "at_pin": before.counters["prefetch_load_completed_chunks"],
        "at_refresh": reloaded.counters["prefetch_load_completed_chunks"]
        - after.counters["prefetch_load_completed_chunks"],
    }
    print(f"\nPIN_LOADS {loads}")
    # pinning a resident prefix loaded nothing; the refresh had to reload all 4 chunks from L2, i.e. the
    # pressure had evicted the pinned prefix and the pin brought it back
    assert loads == {"at_pin": 0.0, "at_refresh": 4.0}

    p_l1 = act.evict([pinned], Tier.CPU)  # L2 copy verified first; outcome says whether L1 held it
    q_l1 = act.evict([other], Tier.CPU)
    print(
        f"\nPIN_FIGURES l1_evicted_chunks={evicted} pinned_in_l1={p_l1.count(Outcome.APPLIED)}/4 "
        f"unpinned_in_l1={q_l1.count(Outcome.APPLIED)}/4"
    )
    assert p_l1.count(Outcome.APPLIED) == 4
    assert q_l1.count(Outcome.APPLIED) == 0 and q_l1.count(Outcome.SKIPPED) == 4
    assert act.unpin([pinned]).count(Outcome.APPLIED) == 1 and act.pinned() == []
    loop.run_until_complete(coll.client.aclose())
    loop.close()
