"""LFU (in-cache counts, O(1) frequency buckets, LRU tie-break) and LFU with dynamic aging (LFU-DA)."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from kvtier.policies.base import HitMask, Policy, Request


class LFUPolicy(Policy):
    """Evict the least frequently used resident block; among equals the least recently used."""

    name = "lfu"

    def __init__(self, capacity_blocks: int, *, seed: int = 0) -> None:
        super().__init__(capacity_blocks, seed=seed)
        self._freq: dict[int, int] = {}
        self._buckets: dict[int, OrderedDict[int, None]] = {}
        self._min = 0

    def _bump(self, b: int) -> None:
        f = self._freq[b]
        bucket = self._buckets[f]
        del bucket[b]
        if not bucket:
            del self._buckets[f]
            if self._min == f:
                self._min = f + 1
        self._freq[b] = f + 1
        self._buckets.setdefault(f + 1, OrderedDict())[b] = None

    def _evict_one(self) -> None:
        while self._min not in self._buckets:
            self._min += 1
        bucket = self._buckets[self._min]
        b, _ = bucket.popitem(last=False)
        if not bucket:
            del self._buckets[self._min]
        del self._freq[b]
        self._evicted.append(b)

    def access(self, req: Request) -> HitMask:
        ids = req.hash_ids.tolist()
        hits = [False] * len(ids)
        if self.capacity_blocks == 0:
            return np.zeros(len(ids), dtype=np.bool_)
        freq = self._freq
        for i, b in enumerate(ids):
            if b in freq:
                hits[i] = True
                self._bump(b)
            else:
                if len(freq) >= self.capacity_blocks:
                    self._evict_one()
                freq[b] = 1
                self._buckets.setdefault(1, OrderedDict())[b] = None
                self._min = 1
        return np.array(hits, dtype=np.bool_)

    def contains(self, block: int) -> bool:
        return block in self._freq

    def __len__(self) -> int:
        return len(self._freq)

    def remove(self, block: int) -> bool:
        f = self._freq.pop(block, None)
        if f is None:
            return False
        bucket = self._buckets[f]
        del bucket[block]
        if not bucket:
            del self._buckets[f]
        return True


class LFUDAPolicy(Policy):
    """LFU with dynamic aging: key = count + L, L = key of the last victim; LRU among equal keys.

    Keys are integers, so blocks sit in O(1) buckets per key (insertion order = LRU order)."""

    name = "lfuda"

    def __init__(self, capacity_blocks: int, *, seed: int = 0) -> None:
        super().__init__(capacity_blocks, seed=seed)
        self._cnt: dict[int, int] = {}
        self._key: dict[int, int] = {}
        self._buckets: dict[int, OrderedDict[int, None]] = {}
        self._age = 0
        self._min = 0

    def _place(self, b: int, k: int) -> None:
        self._key[b] = k
        bucket = self._buckets.get(k)
        if bucket is None:
            bucket = self._buckets[k] = OrderedDict()
        bucket[b] = None
        if k < self._min or len(self._key) == 1:
            self._min = k

    def _unplace(self, b: int) -> None:
        k = self._key.pop(b)
        bucket = self._buckets[k]
        del bucket[b]
        if not bucket:
            del self._buckets[k]

    def _evict_one(self) -> None:
        buckets = self._buckets
        while self._min not in buckets:
            self._min += 1
        k = self._min
        bucket = buckets[k]
        b, _ = bucket.popitem(last=False)
        if not bucket:
            del buckets[k]
        del self._key[b]
        del self._cnt[b]
        self._age = k
        self._evicted.append(b)

    def access(self, req: Request) -> HitMask:
        ids = req.hash_ids.tolist()
        hits = [False] * len(ids)
        if self.capacity_blocks == 0:
            return np.zeros(len(ids), dtype=np.bool_)
        cnt = self._cnt
        for i, b in enumerate(ids):
            c = cnt.get(b)
            if c is not None:
                hits[i] = True
                cnt[b] = c + 1
                self._unplace(b)
            else:
                if len(cnt) >= self.capacity_blocks:
                    self._evict_one()
                cnt[b] = 1
            self._place(b, cnt[b] + self._age)
        return np.array(hits, dtype=np.bool_)

    def contains(self, block: int) -> bool:
        return block in self._cnt

    def __len__(self) -> int:
        return len(self._cnt)

    def remove(self, block: int) -> bool:
        if block not in self._cnt:
            return False
        del self._cnt[block]
        self._unplace(block)
        return True
