"""LRU and FIFO block caches (the two baselines libCacheSim must agree with exactly).

Both serve a request in bulk when that is provably the same as block-by-block processing: the victims
are then exactly the oldest resident blocks and none of them belongs to the request. Otherwise (the
request itself would be cut by its own insertions) they fall back to the exact per-block loop.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from itertools import islice, repeat

import numpy as np

from kvtier.policies.base import HitMask, Policy, Request


class LRUPolicy(Policy):
    """Least recently used: a hit moves the block to the MRU end; a miss inserts it, evicting the LRU one."""

    name = "lru"
    _touch_hits = True  # FIFO: hits keep their place

    def __init__(self, capacity_blocks: int, *, seed: int = 0) -> None:
        super().__init__(capacity_blocks, seed=seed)
        self._od: OrderedDict[int, None] = OrderedDict()

    def access(self, req: Request) -> HitMask:
        od = self._od
        cap = self.capacity_blocks
        ids = req.hash_ids.tolist()
        if cap == 0:
            return np.zeros(len(ids), dtype=np.bool_)
        sid = set(ids)
        if len(sid) != len(ids):  # a block repeated within the request: its second use may hit
            return self.access_exact(ids)
        hits = [b in od for b in ids]
        misses = [b for b, h in zip(ids, hits, strict=True) if not h]
        excess = len(od) + len(misses) - cap
        if excess > 0:
            victims = list(islice(od, excess))
            if len(victims) < excess or not sid.isdisjoint(victims):
                return self.access_exact(ids)
            deque(map(od.pop, victims), 0)
            self._evicted.extend(victims)
        od.update(zip(misses, repeat(None)))
        if self._touch_hits:
            deque(map(od.move_to_end, ids), 0)
        return np.array(hits, dtype=np.bool_)

    def access_exact(self, ids: list[int]) -> HitMask:
        """Serve the block ids ``ids`` one by one (hit mask, as :meth:`access`): the per-block loop that
        :meth:`access` falls back to and that its bulk path must equal."""
        od = self._od
        cap = self.capacity_blocks
        hits = [False] * len(ids)
        move = od.move_to_end
        pop = od.popitem
        push = self._evicted.append
        touch = self._touch_hits
        size = len(od)
        for i, b in enumerate(ids):
            if b in od:
                if touch:
                    move(b)
                hits[i] = True
            else:
                if size >= cap:
                    push(pop(False)[0])
                else:
                    size += 1
                od[b] = None
        return np.array(hits, dtype=np.bool_)

    def contains(self, block: int) -> bool:
        return block in self._od

    def eviction_order(self) -> list[int]:
        """The resident block ids, next victim first (LRU: least recently used first; FIFO: oldest
        insertion first). A copy: O(resident blocks)."""
        return list(self._od)

    def __len__(self) -> int:
        return len(self._od)

    def remove(self, block: int) -> bool:
        return self._od.pop(block, 0) is None


class FIFOPolicy(LRUPolicy):
    """First in, first out: hits do not change the order."""

    name = "fifo"
    _touch_hits = False
