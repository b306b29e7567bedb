"""Leaf-LRU (SGLang RadixAttention style): all blocks of a request share its recency stamp and only blocks
with no resident child can be evicted, so the resident set stays prefix-closed."""

from __future__ import annotations

import heapq

import numpy as np

from kvtier.policies.base import HitMask, Policy, Request


class LeafLRUPolicy(Policy):
    """Evict the least recently used *leaf* (a resident block with no resident child)."""

    name = "leaf-lru"

    def __init__(self, capacity_blocks: int, *, seed: int = 0) -> None:
        super().__init__(capacity_blocks, seed=seed)
        self._ts: dict[int, int] = {}  # resident block -> request stamp
        self._parent: dict[int, int] = {}  # resident block -> parent id (-1 root)
        self._kids: dict[int, int] = {}  # resident block -> resident children
        self._heap: list[tuple[int, int, int]] = []  # (stamp, -depth, block)
        self._pending: list[tuple[int, int]] = []  # (depth, block) of the in-flight request
        self._now = 0

    def _evict_one(self) -> bool:
        heap, ts, kids = self._heap, self._ts, self._kids
        while True:
            while heap:
                stamp, _negd, b = heapq.heappop(heap)
                if ts.get(b) == stamp and kids[b] == 0:
                    self._drop(b)
                    self._evicted.append(b)
                    return True
            if not self._pending:
                return False
            self._flush()  # only the in-flight request's own blocks are left

    def _flush(self) -> None:
        """Queue the in-flight request's blocks that are leaves (pushes are deferred to request end)."""
        ts, kids, heap = self._ts, self._kids, self._heap
        for d, b in self._pending:
            if kids.get(b, 1) == 0:
                heapq.heappush(heap, (ts[b], -d, b))
        self._pending = []

    def _drop(self, b: int) -> None:
        del self._ts[b]
        del self._kids[b]
        p = self._parent.pop(b)
        if p in self._kids:
            self._kids[p] -= 1
            if self._kids[p] == 0:
                heapq.heappush(self._heap, (self._ts[p], 0, p))

    def access(self, req: Request) -> HitMask:
        ids = req.hash_ids.tolist()
        hits = [False] * len(ids)
        if self.capacity_blocks == 0:
            return np.zeros(len(ids), dtype=np.bool_)
        self._now += 1
        now = self._now
        ts, kids, parent = self._ts, self._kids, self._parent
        prev = -1
        for i, b in enumerate(ids):
            if b in ts:
                hits[i] = True
                ts[b] = now
            else:
                while len(ts) >= self.capacity_blocks and self._evict_one():
                    pass
                ts[b] = now
                kids[b] = 0
                p = prev if prev in ts else -1
                parent[b] = p
                if p != -1:
                    kids[p] += 1
            self._pending.append((i, b))
            prev = b
        self._flush()
        if len(self._heap) > 4 * max(64, len(ts)):
            self._heap = [(t, 0, b) for b, t in ts.items() if kids[b] == 0]
            heapq.heapify(self._heap)
        return np.array(hits, dtype=np.bool_)

    def contains(self, block: int) -> bool:
        return block in self._ts

    def __len__(self) -> int:
        return len(self._ts)

    def remove(self, block: int) -> bool:
        if block not in self._ts:
            return False
        for c, p in self._parent.items():  # orphan resident children (rare: only on external removal)
            if p == block:
                self._parent[c] = -1
        self._drop(block)
        return True
