"""ARC (Megiddo & Modha, FAST'03): recency list T1, frequency list T2, ghosts B1/B2, adaptive target p."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from kvtier.policies.base import HitMask, Policy, Request


class ARCPolicy(Policy):
    """Adaptive Replacement Cache over blocks (capacity c; ghost lists hold up to c ids together)."""

    name = "arc"

    def __init__(self, capacity_blocks: int, *, seed: int = 0) -> None:
        super().__init__(capacity_blocks, seed=seed)
        self._t1: OrderedDict[int, None] = OrderedDict()
        self._t2: OrderedDict[int, None] = OrderedDict()
        self._b1: OrderedDict[int, None] = OrderedDict()
        self._b2: OrderedDict[int, None] = OrderedDict()
        self._p = 0.0

    def _replace(self, in_b2: bool) -> None:
        t1, t2 = self._t1, self._t2
        if t1 and (len(t1) > self._p or (in_b2 and len(t1) == self._p)):
            b, _ = t1.popitem(last=False)
            self._b1[b] = None
        elif t2:
            b, _ = t2.popitem(last=False)
            self._b2[b] = None
        else:
            b, _ = t1.popitem(last=False)
            self._b1[b] = None
        self._evicted.append(b)

    def access(self, req: Request) -> HitMask:
        ids = req.hash_ids.tolist()
        hits = [False] * len(ids)
        c = self.capacity_blocks
        if c == 0:
            return np.zeros(len(ids), dtype=np.bool_)
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        replace = self._replace
        for i, x in enumerate(ids):
            if x in t1:
                del t1[x]
                t2[x] = None
                hits[i] = True
            elif x in t2:
                t2.move_to_end(x)
                hits[i] = True
            elif x in b1:
                self._p = min(float(c), self._p + max(len(b2) / len(b1), 1.0))
                if len(t1) + len(t2) >= c:
                    replace(False)
                del b1[x]
                t2[x] = None
            elif x in b2:
                self._p = max(0.0, self._p - max(len(b1) / len(b2), 1.0))
                if len(t1) + len(t2) >= c:
                    replace(True)
                del b2[x]
                t2[x] = None
            else:
                n1 = len(t1)
                l1 = n1 + len(b1)
                if l1 == c:
                    if n1 < c:
                        b1.popitem(last=False)
                        if n1 + len(t2) >= c:
                            replace(False)
                    else:
                        b, _ = t1.popitem(last=False)
                        self._evicted.append(b)
                elif l1 < c:
                    n2 = len(t2)
                    total = l1 + n2 + len(b2)
                    if total >= c:
                        if total >= 2 * c:
                            b2.popitem(last=False)
                        if n1 + n2 >= c:
                            replace(False)
                t1[x] = None
        return np.array(hits, dtype=np.bool_)

    def contains(self, block: int) -> bool:
        return block in self._t1 or block in self._t2

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def remove(self, block: int) -> bool:
        if self._t1.pop(block, 0) is None:
            return True
        return self._t2.pop(block, 0) is None
