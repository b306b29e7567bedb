"""Table-driven unit tests of every baseline policy on small hand-made traces, plus invariants on a
random prefix-tree trace."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.policies.base import Request
from kvtier.policies.lru import LRUPolicy
from kvtier.policies.registry import CLASSIC, get_policy
from kvtier.replay.engine import replay

ALL = [*CLASSIC, "belady"]


def req(*ids: int, t: float = 0.0) -> Request:
    return Request(t, 512 * len(ids), 1, np.asarray(ids, dtype=np.int64))


def run(policy: str, cap: int, trace: list[list[int]]) -> list[list[bool]]:
    reqs = [req(*r, t=i) for i, r in enumerate(trace)]
    p = get_policy(policy, cap)
    if p.offline:
        p.prepare(reqs)
    return [p.access(r).tolist() for r in reqs]


F, T = False, True
SMALL = [[1], [2], [1], [3], [2], [1]]
# block 1 is used 3 times, then a scan of 20 one-hit blocks (cap 10), then block 1 again
SCAN = [[1], [1], [1], *[[b] for b in range(2, 22)], [1]]
# a 3-block chain, an unrelated block, then the chain again (cap 3)
CHAIN = [[1, 2, 3], [4], [1, 2, 3]]

CASES = [
    ("lru", 2, SMALL, [[F], [F], [T], [F], [F], [F]]),
    ("fifo", 2, SMALL, [[F], [F], [T], [F], [T], [F]]),
    ("lfu", 2, SMALL, [[F], [F], [T], [F], [F], [T]]),
    ("belady", 2, SMALL, [[F], [F], [T], [F], [T], [F]]),
    ("lru", 3, CHAIN, [[F, F, F], [F], [F, F, F]]),
    ("fifo", 3, CHAIN, [[F, F, F], [F], [F, F, F]]),
    ("leaf-lru", 3, CHAIN, [[F, F, F], [F], [T, T, F]]),
    ("belady", 3, CHAIN, [[F, F, F], [F], [T, T, F]]),  # evicts 3: used last
]


@pytest.mark.parametrize(("policy", "cap", "trace", "expected"), CASES)
def test_hand_traces(policy: str, cap: int, trace: list[list[int]], expected: list[list[bool]]) -> None:
    assert run(policy, cap, trace) == expected


SCAN_LAST_HIT = {
    "lru": False, "fifo": False, "leaf-lru": False,  # recency only: the scan flushes block 1
    "lfu": True, "lfuda": True, "s3fifo": True, "arc": True, "belady": True,  # frequency / ghost / future
}  # fmt: skip


@pytest.mark.parametrize("policy", ALL)
def test_scan_resistance(policy: str) -> None:
    out = run(policy, 10, SCAN)
    assert out[0] == [False] and out[1] == [True] and out[2] == [True]
    assert all(o == [False] for o in out[3:23]), "scan blocks are all first touches"
    assert out[-1] == [SCAN_LAST_HIT[policy]]


def random_tree_trace(n: int, seed: int) -> list[Request]:
    """Requests that extend earlier chains (conversation turns) or start new ones."""
    rng = np.random.default_rng(seed)
    chains: list[list[int]] = []
    nxt = 0
    out = []
    for i in range(n):
        if chains and rng.random() < 0.6:
            base = list(chains[int(rng.integers(len(chains)))])
            base = base[: int(rng.integers(1, len(base) + 1))]
        else:
            base = []
        k = int(rng.integers(1, 6))
        base = base + list(range(nxt, nxt + k))
        nxt += k
        chains.append(base)
        out.append(Request(float(i), 512 * len(base) - int(rng.integers(0, 512)), 10, np.asarray(base)))
    return out


@pytest.mark.parametrize("policy", ALL)
@pytest.mark.parametrize("cap", [0, 1, 7, 40])
def test_invariants(policy: str, cap: int) -> None:
    reqs = random_tree_trace(300, seed=cap)
    p = get_policy(policy, cap, seed=1)
    if p.offline:
        p.prepare(reqs)
    resident: set[int] = set()
    for r in reqs:
        before = [p.contains(int(b)) for b in r.hash_ids]
        hits = p.access(r)
        assert hits.dtype == np.bool_ and hits.shape == r.hash_ids.shape
        assert len(p) <= cap
        ev = p.drain_evicted()
        ids = r.hash_ids.tolist()
        for b, was, hit in zip(ids, before, hits.tolist(), strict=True):
            # a hit was resident before the request; a resident block misses only if evicted meanwhile
            assert was or not hit
            assert hit or not was or b in ev
        assert all(not p.contains(b) for b in ev if b not in ids)
        resident |= set(ids)
    assert len(p) == sum(p.contains(b) for b in resident)


@pytest.mark.parametrize("policy", ALL)
def test_deterministic(policy: str) -> None:
    reqs = random_tree_trace(200, seed=3)
    a = replay(reqs, get_policy(policy, 20, seed=5))
    b = replay(reqs, get_policy(policy, 20, seed=5))
    assert (a.block_hits, a.prefix_hit_tokens) == (b.block_hits, b.prefix_hit_tokens)


@pytest.mark.parametrize("policy", [p for p in ALL if p != "belady"])
def test_remove(policy: str) -> None:
    p = get_policy(policy, 4)
    p.access(req(1, 2, 3))
    assert p.remove(3) is True
    assert not p.contains(3) and len(p) == 2
    assert p.remove(3) is False
    assert p.access(req(3)).tolist() == [False]
    assert p.drain_evicted() == []  # a removal is not an eviction


def test_unknown_policy() -> None:
    with pytest.raises(KeyError, match="unknown policy 'nope'"):
        get_policy("nope", 10)


def test_prefix_tokens_rule() -> None:
    """Reusable tokens stop at the first missing block; all blocks hit -> whole input_length."""
    from kvtier.replay.engine import prefix_tokens

    r = Request(0.0, 1300, 1, np.asarray([1, 2, 3]))
    assert [prefix_tokens(r, k) for k in range(4)] == [0, 512, 1024, 1300]
    assert prefix_tokens(Request(0.0, 100, 1, np.zeros(0, dtype=np.int64)), 0) == 0
    p = get_policy("lru", 10)
    s = replay([r, Request(1.0, 1400, 1, np.asarray([1, 2, 9]))], p)
    assert s.prefix_hit_tokens == 1024 and s.input_tokens == 2700 and s.block_hits == 2


def test_belady_refuses_unprepared_sequence() -> None:
    p = get_policy("belady", 2)
    p.prepare([req(1, 2), req(3)])
    p.access(req(1, 2))
    with pytest.raises(RuntimeError, match="differs"):
        p.access(req(4))


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_bulk_path_equals_exact_loop(policy: str) -> None:
    """LRU/FIFO serve requests in bulk when provably equivalent; compare with the per-block loop."""
    reqs = random_tree_trace(400, seed=11) + [req(5, 5, 6), req(6, 7, 6)]  # incl. repeated ids
    for cap in (1, 3, 8, 30, 200):
        bulk, exact = get_policy(policy, cap), get_policy(policy, cap)
        assert isinstance(bulk, LRUPolicy) and isinstance(exact, LRUPolicy)  # FIFOPolicy is one too
        for r in reqs:
            a = bulk.access(r)
            b = exact.access_exact(r.hash_ids.tolist())
            assert a.tolist() == b.tolist()
            assert bulk.drain_evicted() == exact.drain_evicted()
            assert bulk.eviction_order() == exact.eviction_order()
