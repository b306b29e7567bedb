"""S3-FIFO (Yang et al., SOSP'23, Algorithm 1): small FIFO (10 %), 2-bit main FIFO, ghost."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from kvtier.policies.base import HitMask, Policy, Request


class S3FIFOPolicy(Policy):
    """Small FIFO S = 10 % of capacity, main FIFO M = the rest, ghost G of |M| ids.

    A hit bumps the block's 2-bit counter (max 3). A miss found in G goes to M, otherwise to S. Evicting
    from S moves blocks with counter >= ``move_threshold`` (2: the paper's ``freq > 1``) to M, others to G;
    evicting from M reinserts blocks with counter > 0 (decrementing it)."""

    name = "s3fifo"

    def __init__(
        self, capacity_blocks: int, *, seed: int = 0, small_ratio: float = 0.1, move_threshold: int = 2
    ):
        super().__init__(capacity_blocks, seed=seed)
        self.small_cap = max(1, round(small_ratio * capacity_blocks)) if capacity_blocks > 1 else 0
        self.main_cap = capacity_blocks - self.small_cap
        self.move_threshold = move_threshold
        self._s: OrderedDict[int, None] = OrderedDict()  # insertion order: first = tail (oldest)
        self._m: OrderedDict[int, None] = OrderedDict()
        self._g: OrderedDict[int, None] = OrderedDict()
        self._f: dict[int, int] = {}

    def _ghost_add(self, b: int) -> None:
        g = self._g
        g[b] = None
        g.move_to_end(b)
        while len(g) > max(1, self.main_cap):
            g.popitem(last=False)

    def _evict_m(self) -> None:
        m, f = self._m, self._f
        while m:
            b, _ = m.popitem(last=False)
            c = f[b]
            if c > 0:
                f[b] = c - 1
                m[b] = None
            else:
                del f[b]
                self._evicted.append(b)
                return

    def _evict_s(self) -> None:
        s, m, f = self._s, self._m, self._f
        while s:
            b, _ = s.popitem(last=False)
            if f[b] >= self.move_threshold:
                m[b] = None
                if len(m) > self.main_cap:
                    self._evict_m()
            else:
                del f[b]
                self._ghost_add(b)
                self._evicted.append(b)
                return

    def _evict(self) -> None:
        if len(self._s) >= self.small_cap or not self._m:
            self._evict_s()
            if len(self._s) + len(self._m) >= self.capacity_blocks:  # all moved to M without an eviction
                self._evict_m()
        else:
            self._evict_m()

    def access(self, req: Request) -> HitMask:
        ids = req.hash_ids.tolist()
        cap = self.capacity_blocks
        if cap == 0:
            return np.zeros(len(ids), dtype=np.bool_)
        f, s, m, g = self._f, self._s, self._m, self._g
        get = f.get
        hits = [False] * len(ids)
        evict = self._evict
        for i, b in enumerate(ids):
            c = get(b)
            if c is not None:
                hits[i] = True
                if c < 3:
                    f[b] = c + 1
                continue
            if len(f) >= cap:  # resident = S + M = keys of f
                evict()
                while len(f) >= cap:
                    evict()
            f[b] = 0
            if b in g:
                del g[b]
                m[b] = None
            else:
                s[b] = None
        return np.array(hits, dtype=np.bool_)

    def contains(self, block: int) -> bool:
        return block in self._f

    def __len__(self) -> int:
        return len(self._f)

    def remove(self, block: int) -> bool:
        if self._f.pop(block, None) is None:
            return False
        if self._s.pop(block, 0) is not None:
            self._m.pop(block, None)
        return True
