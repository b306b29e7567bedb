"""Belady's MIN with forced admission (offline upper bound; replay only).

Evicts the resident block whose next use is furthest in the future; blocks never used again go first,
deepest first (which keeps the resident set prefix-closed, so every block hit is a prefix hit)."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from kvtier.policies.base import HitMask, Policy, Request


class BeladyPolicy(Policy):
    """Needs :meth:`prepare` with the exact request sequence it will then be fed, in order."""

    name = "belady"
    offline = True

    def __init__(self, capacity_blocks: int, *, seed: int = 0) -> None:
        super().__init__(capacity_blocks, seed=seed)
        self._next: np.ndarray = np.zeros(0, dtype=np.int64)
        self._ids: np.ndarray = np.zeros(0, dtype=np.int64)
        self._pos = 0
        self._nu: dict[int, int] = {}  # resident block -> next use position
        self._depth: dict[int, int] = {}
        self._heap: list[tuple[int, int, int]] = []  # (-next_use, -depth, block)

    def prepare(self, requests: Sequence[Request]) -> None:
        ids = np.concatenate([r.hash_ids for r in requests]) if requests else np.zeros(0, dtype=np.int64)
        n = ids.size
        order = np.argsort(ids, kind="stable")
        nxt = np.full(n, 2 * n + 1, dtype=np.int64)  # never again: beyond any real position
        same = ids[order[1:]] == ids[order[:-1]]
        nxt[order[:-1][same]] = order[1:][same]
        self._next = nxt
        self._ids = ids
        self._pos = 0

    def access(self, req: Request) -> HitMask:
        ids = req.hash_ids.tolist()
        n = len(ids)
        if self._pos + n > self._next.size:
            raise RuntimeError("belady: fed more accesses than prepare() saw")
        if not np.array_equal(self._ids[self._pos : self._pos + n], req.hash_ids):
            raise RuntimeError(f"belady: request at access {self._pos} differs from what prepare() saw")
        nexts = self._next[self._pos : self._pos + n].tolist()
        self._pos += n
        hits = [False] * n
        if self.capacity_blocks == 0:
            return np.zeros(n, dtype=np.bool_)
        nu, depth, heap = self._nu, self._depth, self._heap
        for i, b in enumerate(ids):
            if b in nu:
                hits[i] = True
            else:
                if len(nu) >= self.capacity_blocks:
                    while True:
                        negn, _negd, v = heapq.heappop(heap)
                        if nu.get(v) == -negn:
                            del nu[v]
                            del depth[v]
                            self._evicted.append(v)
                            break
                depth[b] = i
            nu[b] = nexts[i]
            heapq.heappush(heap, (-nexts[i], -depth[b], b))
        if len(heap) > 4 * max(64, len(nu)):
            self._heap = [(-x, -depth[b], b) for b, x in nu.items()]
            heapq.heapify(self._heap)
        return np.array(hits, dtype=np.bool_)

    def contains(self, block: int) -> bool:
        return block in self._nu

    def __len__(self) -> int:
        return len(self._nu)

    def remove(self, block: int) -> bool:
        if self._nu.pop(block, None) is None:
            return False
        del self._depth[block]
        return True
