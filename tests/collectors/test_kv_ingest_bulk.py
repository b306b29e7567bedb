"""The KV-event ingestor's bulk path (grouped removals, chain stores, column op queue, vectorised index
flush) gives the same counters, residency and block index as applying the documented semantics event by
event, hash by hash, with one-by-one BlockIndex calls -- on randomised multi-engine, multi-tier streams with
re-announcements, blocks shared between engines, unknown / duplicate removals, clears and restarts."""

from __future__ import annotations

import random
from collections import Counter, defaultdict

import numpy as np
import pytest

from kvtier.collectors.kv_ingest import KvIngestor, SourceCounts
from kvtier.collectors.vllm_events import AllBlocksCleared, BlockRemoved, BlockStored, tier_of
from kvtier.policies.index import BlockIndex
from kvtier.policies.tiers import TIER_ORDER, Tier

Ev = BlockStored | BlockRemoved | AllBlocksCleared
MEDIA = ["GPU", "GPU", None, "cpu", "CPU", "STORAGE"]


class RefIngestor:
    """Reference: the module docstring's rules applied one hash at a time to a BlockIndex. Stores and removals
    apply at once; accesses are recorded (if the block is tracked at that moment) and applied at :meth:`flush`
    in time order, walking parent chains then -- the bulk path's documented order for statistics.

    Checked with the index flushed after every batch; over much longer windows the bulk path's relaxations
    (policies/index_bulk.py: rounds, accesses and depths resolved at the end of the window) show."""

    def __init__(self) -> None:
        self.index = BlockIndex(initial_capacity=16)
        self.pending: list[tuple[float, bool, int]] = []  # (t ms, walk the parent chain, key)
        self.held: dict[str, dict[Tier, set[int]]] = defaultdict(lambda: {t: set() for t in TIER_ORDER})
        self.rc: dict[Tier, Counter[int]] = {t: Counter() for t in TIER_ORDER}
        self.counts: dict[str, SourceCounts] = defaultdict(SourceCounts)

    def _access(self, k: int, t: float, chain: bool = False) -> None:
        if k in self.index:
            self.pending.append((t, chain, k))

    def flush(self) -> None:
        idx = self.index
        for t, chain, k in sorted(self.pending, key=lambda x: x[0]):
            s, steps = idx.slot_of(k), 0
            while s >= 0 and steps < 4096:
                idx.touch(idx.hash_of(s), t)
                s, steps = (int(idx.parent[s]) if chain else -1), steps + 1
        self.pending.clear()

    def _unref(self, tier: Tier, k: int) -> None:
        self.rc[tier][k] -= 1
        if self.rc[tier][k] <= 0:
            del self.rc[tier][k]
            self.index.remove(k, tier)

    def _clear(self, mine: set[int], tier: Tier) -> int:
        n = len(mine)
        for k in mine:
            self._unref(tier, k)
        mine.clear()
        return n

    def apply_events(self, engine: str, events: list[Ev], t: float, source: str | None = None) -> None:
        held, c, idx = self.held[source or engine], self.counts[engine], self.index
        for e in events:
            c.events[type(e).__name__] += 1
            tier = tier_of(e.medium)
            mine = held[tier]
            if isinstance(e, BlockRemoved):
                for k in e.block_hashes:
                    if k in mine:
                        mine.discard(k)
                        c.blocks_removed += 1
                        self._unref(tier, k)
                    else:
                        c.removed_unknown += 1
            elif isinstance(e, BlockStored):
                p = e.parent_block_hash
                if p is not None:
                    c.accesses_inferred += 1
                    self._access(p, t, chain=True)
                for k in e.block_hashes:
                    if k in mine:
                        c.blocks_reannounced += 1
                        c.accesses_inferred += 1
                        self._access(k, t)
                    else:
                        mine.add(k)
                        c.blocks_stored += 1
                        if self.rc[tier][k]:
                            self._access(k, t)
                        else:
                            idx.store(k, p, tier, 0, t)
                        self.rc[tier][k] += 1
                    p = k
            else:
                c.blocks_cleared += self._clear(mine, tier)

    def clear_source(self, engine: str, source: str | None = None) -> int:
        held = self.held[source or engine]
        n = sum(self._clear(held[t], t) for t in TIER_ORDER)
        self.counts[engine].blocks_cleared += n
        return n


def scenario(seed: int, n_batches: int = 400) -> list[tuple[str, str | None, list[Ev] | None, float]]:
    """(engine, source, events or None for a restart, t_ms) steps."""
    rng = random.Random(seed)
    paths: list[list[int]] = []  # root-first hash paths; a hash always has the same parent (a tree)
    sources = [("a", None), ("a", "a/dp1"), ("b", None)]
    held: dict[str, list[int]] = defaultdict(list)
    steps: list[tuple[str, str | None, list[Ev] | None, float]] = []
    t = 0.0
    for _ in range(n_batches):
        t += rng.random() * 20
        engine, source = rng.choice(sources)
        label = source or engine
        if rng.random() < 0.02:
            steps.append((engine, source, None, t))
            held[label].clear()
            continue
        events: list[Ev] = []
        for _ in range(rng.randrange(1, 4)):
            medium = rng.choice(MEDIA)
            if paths and rng.random() < 0.6:  # continue or re-announce a known prefix
                base = rng.choice(paths)
                cut = rng.randrange(1, len(base) + 1)
                path = base[:cut] + [rng.getrandbits(64) for _ in range(rng.randrange(0, 6))]
                j = rng.randrange(0, len(path))
            else:
                path = [rng.getrandbits(64) for _ in range(rng.randrange(1, 9))]
                j = 0
            paths.append(path)
            hs = path[j:]
            events.append(BlockStored(block_hashes=hs, parent_block_hash=path[j - 1] if j else None,
                                      medium=medium))  # fmt: skip
            held[label].extend(hs)
        if rng.random() < 0.03:
            events.append(AllBlocksCleared(medium=rng.choice([None, "cpu"])))
        for _ in range(rng.randrange(0, 10)):  # removals, one hash each (as vLLM) or several
            pool = held[label]
            if pool and rng.random() < 0.9:
                n = min(len(pool), rng.choice([1, 1, 3]))
                ks = [pool.pop(rng.randrange(len(pool))) for _ in range(n)]
            else:
                ks = [rng.getrandbits(64)]
            if rng.random() < 0.05:
                ks = ks + ks[:1]  # a duplicate inside one event
            events.append(BlockRemoved(block_hashes=ks, medium=rng.choice(MEDIA)))
        steps.append((engine, source, events, t))
    return steps


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("flush_every", [1])  # the index is flushed after every batch
def test_bulk_ingest_equals_one_by_one(seed: int, flush_every: int) -> None:
    ref, ing = RefIngestor(), KvIngestor(BlockIndex(initial_capacity=16), flush_every=flush_every)
    for engine, source, events, t in scenario(seed):
        for x in (ref, ing):
            if events is None:
                x.clear_source(engine, source)
            else:
                x.apply_events(engine, events, t, source)
        ref.flush()
        assert ing.blocks_tracked() == {t.value: len(ref.rc[t]) for t in TIER_ORDER}
    assert dict(ing.counts) == dict(ref.counts)
    for label, tiers in ref.held.items():
        for tier, mine in tiers.items():
            assert ing.held(label, tier) == len(mine)
    ref.flush()
    a, b = ref.index, ing.flushed_index()
    assert len(a) == len(b) and a.count_by_tier() == b.count_by_tier()
    assert b.count_by_tier() == {t: len(ref.rc[t]) for t in TIER_ORDER}
    for k in a.hash[np.flatnonzero(a.used[: a.n_rows])].tolist():
        sa, sb = a.get(k), b.get(k)
        assert sa is not None and sb is not None
        assert sa.tiers == sb.tiers and sa.parent == sb.parent and sa.depth == sb.depth
        assert sa.frequency == sb.frequency and sa.last_access_ms == sb.last_access_ms
        assert sa.children == sb.children and sa.resident_children == sb.resident_children
        assert sa.first_seen_ms == sb.first_seen_ms
        np.testing.assert_allclose(sa.gap_ewma_ms, sb.gap_ewma_ms, rtol=1e-5, equal_nan=True)
