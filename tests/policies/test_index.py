"""BlockIndex: prefix links, per-tier residency, statistics, leaf-first victims, uint64 hashes, bounds."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvtier.policies.index import BlockIndex, IndexFullError, to_key
from kvtier.policies.tiers import Tier

BIG = (1 << 64) - 5  # a vLLM uint64 hash above int64 range


def test_store_links_and_depth() -> None:
    ix = BlockIndex()
    assert ix.store_chain([10, 11, 12], None, "gpu", nbytes=100, t=1.0) == 3
    s = ix.get(12)
    assert s is not None and s.parent == 11 and s.depth == 2 and s.tiers == (Tier.GPU,)
    assert ix.get(10).children == 1 and ix.get(10).resident_children[Tier.GPU] == 1  # type: ignore[union-attr]
    assert ix.count_by_tier() == {Tier.GPU: 3, Tier.CPU: 0, Tier.DISK: 0, Tier.REMOTE: 0}
    assert ix.bytes_by_tier()[Tier.GPU] == 300
    assert ix.store(12, 11, "gpu") is False  # already there
    assert ix.get(99) is None and 99 not in ix


def test_uint64_hashes_fold_to_one_slot() -> None:
    ix = BlockIndex()
    ix.store(BIG, None, Tier.CPU, t=0)
    assert BIG in ix and to_key(BIG) in ix and to_key(BIG) < 0
    ix.store(BIG - 1, BIG, "cpu")
    assert ix.get(BIG - 1).parent == to_key(BIG)  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="64 bits"):
        ix.store(1 << 64, None, "cpu")


def test_multi_tier_remove_clear() -> None:
    ix = BlockIndex()
    ix.store_chain([1, 2], None, "gpu")
    ix.store_chain([1, 2], None, "cpu")
    assert ix.get(2).tiers == (Tier.GPU, Tier.CPU)  # type: ignore[union-attr]
    assert ix.remove(2, "gpu") is True and ix.remove(2, "gpu") is False
    assert ix.get(1).resident_children == {Tier.GPU: 0, Tier.CPU: 1, Tier.DISK: 0, Tier.REMOTE: 0}  # type: ignore[union-attr]
    assert ix.clear("cpu") == 2
    assert ix.count_by_tier()[Tier.CPU] == 0 and ix.count_by_tier()[Tier.GPU] == 1
    assert ix.clear() == 1
    assert len(ix) == 2  # stats survive removal
    with pytest.raises(ValueError, match="unknown tier"):
        ix.store(3, None, "floppy")


def test_touch_gaps() -> None:
    ix = BlockIndex()
    ix.store(5, None, "gpu", t=100.0)
    s = ix.get(5)
    assert s is not None and s.frequency == 1 and math.isnan(s.last_gap_ms)
    ix.touch(5, 150.0)
    ix.touch(5, 250.0)
    s = ix.get(5)
    assert s is not None and s.frequency == 3 and s.last_gap_ms == 100.0 and s.last_access_ms == 250.0
    assert s.gap_ewma_ms == pytest.approx(0.7 * 50 + 0.3 * 100)
    assert ix.touch(6, 1.0) is False
    slots = ix.access_chain([5, 7, 8], 300.0)
    s8 = ix.get(8)
    assert s8 is not None and s8.parent == 7 and s8.depth == 2
    assert slots.tolist() == [ix.slot_of(h) for h in (5, 7, 8)]


def test_leaf_first_victims() -> None:
    ix = BlockIndex()
    # tree: 1 -> 2 -> 3, 1 -> 4 ; 1 is oldest, 3 newest
    ix.store(1, None, "gpu", t=1)
    ix.store(2, 1, "gpu", t=2)
    ix.store(3, 2, "gpu", t=5)
    ix.store(4, 1, "gpu", t=3)
    assert not ix.is_evictable(1, "gpu") and ix.is_evictable(3, "gpu") and ix.is_evictable(4, "gpu")
    assert sorted(ix.hash_of(s) for s in ix.leaves("gpu")) == [3, 4]
    # LRU would pick 1, 2 first; leaf-first picks 4 (oldest leaf), then 3, then 2, then 1
    assert ix.pick_victims("gpu", 2) == [4, 3]
    assert ix.pick_victims("gpu", 10) == [4, 3, 2, 1]
    assert ix.count_by_tier()[Tier.GPU] == 4  # picking does not modify
    # a child resident only in another tier does not pin its parent in this tier
    ix.remove(3, "gpu")
    ix.store(3, 2, "cpu")
    assert ix.is_evictable(2, "gpu")
    score = np.zeros(ix.capacity)
    score[ix.slot_of(2)] = -1.0
    assert ix.pick_victims("gpu", 1, score=score) == [2]


def test_growth_and_memory_bound() -> None:
    """Measured (tracemalloc) bytes per tracked block with random uint64 hashes stay <= 256."""
    import tracemalloc

    n = 65_536  # a power of two: arrays exactly full, the worst case is right after a doubling
    hashes = np.random.default_rng(0).integers(0, 2**63, n, dtype=np.int64).tolist()
    hashes = [h + (1 << 63) if i % 2 else h for i, h in enumerate(hashes)]  # half above int64 range
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    ix = BlockIndex(initial_capacity=16)
    prev = None
    for i, h in enumerate(hashes):
        ix.store(h, prev if i % 50 else None, "gpu", t=float(i))
        prev = h
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del hashes  # the caller's list is not the index's memory
    assert len(ix) == n and ix.capacity == n
    assert ix.get(prev).depth == (n - 1) % 50  # type: ignore[union-attr,arg-type]
    per_block = used / n
    assert per_block <= 256, per_block
    assert abs(ix.nbytes_per_block() - per_block) < 64  # the estimate is honest


def test_max_blocks_reclaims_stale_unresident() -> None:
    ix = BlockIndex(initial_capacity=16, max_blocks=64)
    for h in range(64):
        ix.store(h, None, "gpu", t=float(h))
    for h in range(32):
        ix.remove(h, "gpu")
    ix.store(1000, None, "gpu", t=1000.0)  # full: reclaims the stalest non-resident blocks
    assert 1000 in ix and ix.reclaimed > 0 and 0 not in ix and 63 in ix
    assert len(ix) <= 64
    full = BlockIndex(initial_capacity=16, max_blocks=16)
    for h in range(16):
        full.store(h, None, "gpu")
    with pytest.raises(IndexFullError):
        full.store(99, None, "gpu")
