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
    for cap in (200, 10_000):  # evicting, and never full
        ev_a, hit_a, peak_a = _run(None, cap)
        ev_b, hit_b, peak_b = _run(10**9, cap)  # never compacts
        assert ev_a == ev_b and hit_a == hit_b
        assert peak_a <= 300 + 300 // 4 + 4096 + 12  # <= 300 live leaves (one per chain) + <= 12 a request
        assert peak_b >= peak_a


def test_a_cache_that_only_hits_still_compacts() -> None:
    """Every request a full hit (the cache holds the whole working set): each one re-pushes its leaf, and
    the hit path compacts too, so the heap stays bounded (it used to grow by one entry per request)."""
    ev_a, hit_a, peak_a = _run(None, 10_000, full=True)
    ev_b, hit_b, peak_b = _run(10**9, 10_000, full=True)
    assert ev_a == ev_b and hit_a == hit_b and all(not e for e in ev_a)
    assert peak_a <= 300 + 300 // 4 + 4096 + 1
    assert peak_b > 15_000  # without compaction: ~one entry per request


class _Reference:
    """The planner's contract without a heap: a block admitted over capacity evicts the resident leaf
    with the smallest ``(key, slot)``, the newcomer included (then the rest of the request is bypassed);
    admission stops at a block already resident or whose parent is not; a slot listed twice keeps its
    last key."""

    def __init__(self, cap: int, size: int, parent: np.ndarray) -> None:
        self.cap, self.parent = cap, parent.tolist()
        self.res, self.rc, self.key = [False] * size, [0] * size, [0.0] * size

    def serve(self, slots: list[int], keys: list[float]) -> tuple[list[bool], list[int]]:
        hit = [self.res[s] for s in slots]
        for s, k in zip(slots, keys, strict=True):
            self.key[s] = k
        n_hit = hit.index(False) if False in hit else len(slots)
        ev: list[int] = []
        if self.cap <= 0:
            return hit, ev
        for i in range(n_hit, len(slots)):
            s, p = slots[i], self.parent[slots[i]]
            if self.res[s] or (p >= 0 and not self.res[p]):
                break
            self.res[s] = True
            if p >= 0:
                self.rc[p] += 1
            if sum(self.res) <= self.cap:
                continue
            _, v = min((self.key[v], v) for v in range(len(self.res)) if self.res[v] and self.rc[v] == 0)
            self.res[v] = False
            if self.parent[v] >= 0:
                self.rc[self.parent[v]] -= 1
            ev.append(v)
            if v == s:
                break
        return hit, ev


def test_serve_follows_the_reference_contract_on_irregular_requests() -> None:
    """Random forests and requests that are not always root-first chains (a known block after a new one,
    a block twice, a branch): hits and evictions equal the heap-free reference, request for request."""
    rng = np.random.default_rng(5)
    size = 400
    parent = np.full(size, -1, dtype=np.int64)
    for s in range(1, size):
        if rng.random() < 0.85:
            parent[s] = int(rng.integers(max(0, s - 8), s))
    chains = []
    for s in range(size):
        c = [s]
        while parent[c[-1]] >= 0:
            c.append(int(parent[c[-1]]))
        chains.append(c[::-1])
    for cap in (0, 1, 7, 40, 150):
        pl, ref = KeyedPlanner(cap, 1.0, size), _Reference(cap, size, parent)
        for t in range(3000):
            req = list(chains[int(rng.integers(0, size))])
            r = rng.random()
            if r < 0.1:
                req.append(req[-1])  # a block twice
            elif r < 0.2:
                req.insert(int(rng.integers(0, len(req))), int(rng.integers(0, size)))  # an odd block
            keys = (rng.integers(-3, 4, size=len(req)) + t // 10).astype(np.float64)  # ties on purpose
            ev: list[int] = []
            hit = pl.serve(np.array(req, dtype=np.int64), keys, parent.data, ev)
            want_hit, want_ev = ref.serve(req, keys.tolist())
            assert hit.tolist() == want_hit and ev == want_ev, (cap, t)
            assert pl.n_resident == sum(ref.res) <= max(cap, 0)
