"""LRU and FIFO block caches (the two baselines libCacheSim must agree with exactly)."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from kvtier.policies.base import HitMask, Policy, Request


class LRUPolicy(Policy):
    """Least recently used: a hit moves the block to the MRU end; a miss inserts it, evicting the LRU block."""

    name = "lru"

    def __init__(self, capacity_blocks: int, *, seed: int = 0) -> None:
        super().__init__(capacity_blocks, seed=seed)
        self._od: OrderedDict[int, None] = OrderedDict()

    def access(self, req: Request) -> HitMask:
        od = self._od
        cap = self.capacity_blocks
        ids = req.hash_ids.tolist()
        hits = [False] * len(ids)
        if cap == 0:
            return np.zeros(len(ids), dtype=np.bool_)
        move = od.move_to_end
        evicted = self._evicted
        for i, b in enumerate(ids):
            if b in od:
                move(b)
                hits[i] = True
            else:
                if len(od) >= cap:
                    evicted.append(od.popitem(last=False)[0])
                od[b] = None
        return np.array(hits, dtype=np.bool_)

    def contains(self, block: int) -> bool:
        return block in self._od

    def __len__(self) -> int:
        return len(self._od)

    def remove(self, block: int) -> bool:
        return self._od.pop(block, 0) is None


class FIFOPolicy(LRUPolicy):
    """First in, first out: hits do not change the order."""

    name = "fifo"

    def access(self, req: Request) -> HitMask:
        od = self._od
        cap = self.capacity_blocks
        ids = req.hash_ids.tolist()
        hits = [False] * len(ids)
        if cap == 0:
            return np.zeros(len(ids), dtype=np.bool_)
        evicted = self._evicted
        for i, b in enumerate(ids):
            if b in od:
                hits[i] = True
            else:
                if len(od) >= cap:
                    evicted.append(od.popitem(last=False)[0])
                od[b] = None
        return np.array(hits, dtype=np.bool_)
