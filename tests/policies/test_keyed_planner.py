"""KeyedPlanner: heap compaction bounds stale entries without changing a single decision."""

from __future__ import annotations

import numpy as np

from kvtier.policies.keyed_planner import KeyedPlanner


def _run(limit_fixed: int | None, cap: int, full: bool = False) -> tuple[list[list[int]], list[bytes], int]:
    rng = np.random.default_rng(11)
    n_chains, depth = 300, 12
    size = n_chains * depth
    parent = np.full(size, -1, dtype=np.int64)
    for c in range(n_chains):
        parent[c * depth + 1 : (c + 1) * depth] = np.arange(c * depth, (c + 1) * depth - 1)
    pl = KeyedPlanner(cap, 1.0, size)
    evicted: list[list[int]] = []
    hits: list[bytes] = []
    peak = 0
    for t in range(20000):
        c = int(rng.zipf(1.3)) % n_chains
        d = depth if full else int(rng.integers(1, depth + 1))
        slots = np.arange(c * depth, c * depth + d, dtype=np.int64)
        keys = rng.normal(size=d) + t / 50.0
        if limit_fixed is not None:
            pl.heap_limit = limit_fixed
        ev: list[int] = []
        hits.append(pl.serve(slots, keys, parent.data, ev).tobytes())
        evicted.append(ev)
        peak = max(peak, len(pl.heap))
        assert pl.n_resident <= cap
    return evicted, hits, peak


def test_compaction_keeps_decisions_and_bounds_the_heap() -> None:
    for cap in (200, 10_000):  # evicting, and never full (no pops: stale entries pile up)
        ev_a, hit_a, peak_a = _run(None, cap)
        ev_b, hit_b, peak_b = _run(10**9, cap)  # never compacts
        assert ev_a == ev_b and hit_a == hit_b
        assert peak_a <= 300 + 300 // 4 + 4096 + 12  # <= 300 live leaves (one per chain) + <= 12 a request
    assert peak_b > peak_a  # the never-full cache: stale entries pile up without compaction


def test_a_cache_that_only_hits_still_compacts() -> None:
    """Every request a full hit (the cache holds the whole working set): each one re-pushes its leaf, and
    the hit path compacts too, so the heap stays bounded (it used to grow by one entry per request)."""
    ev_a, hit_a, peak_a = _run(None, 10_000, full=True)
    ev_b, hit_b, peak_b = _run(10**9, 10_000, full=True)
    assert ev_a == ev_b and hit_a == hit_b and all(not e for e in ev_a)
    assert peak_a <= 300 + 300 // 4 + 4096 + 1
    assert peak_b > 15_000  # without compaction: ~one entry per request
