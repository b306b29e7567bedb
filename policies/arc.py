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


_T1, _T2, _B1, _B2 = 1, 2, 3, 4  # list ids in SlotARC.where (0 = in no list)


class SlotARC:
    """:class:`ARCPolicy` over dense slots ``0..size-1`` (same decisions, ids replaced by slots): the four
    lists are intrusive doubly linked lists in int32 arrays (``prev``/``next``) plus a uint8 list id per
    slot, 9 bytes per slot instead of an OrderedDict entry and an int object (~130 bytes) per block.
    Used as a full-size shadow expert by ``learned``, whose slots never change once assigned."""

    name = "arc"

    def __init__(self, capacity_blocks: int, size: int) -> None:
        self.capacity_blocks = capacity_blocks
        self.where = np.zeros(size, dtype=np.uint8)
        self.prev = np.full(size, -1, dtype=np.int32)
        self.next = np.full(size, -1, dtype=np.int32)
        self.head = [-1] * 5  # per list id: LRU end
        self.tail = [-1] * 5  # per list id: MRU end
        self.count = [0] * 5
        self._p = 0.0
        self._views()

    def _views(self) -> None:
        self._w, self._pv, self._nx = self.where.data, self.prev.data, self.next.data

    def grow(self, new: int) -> None:
        """Room for slots ``0..new-1``."""
        size = self.where.shape[0]
        if new <= size:
            return
        if new > np.iinfo(np.int32).max:
            raise OverflowError("SlotARC: more than 2**31 - 1 slots")
        for name, fill in (("where", 0), ("prev", -1), ("next", -1)):
            old = getattr(self, name)
            arr = np.full(new, fill, dtype=old.dtype)
            arr[:size] = old
            setattr(self, name, arr)
        self._views()

    def __len__(self) -> int:
        return self.count[_T1] + self.count[_T2]

    def contains(self, slot: int) -> bool:
        return self.where[slot] in (_T1, _T2)

    def _move(self, x: int, dst: int) -> None:
        """Take ``x`` out of its list and put it at the MRU end of ``dst`` (hits and ghost moves)."""
        w, pv, nx, head, tail, cnt = self._w, self._pv, self._nx, self.head, self.tail, self.count
        lst = w[x]
        a, b = pv[x], nx[x]
        if a >= 0:
            nx[a] = b
        else:
            head[lst] = b
        if b >= 0:
            pv[b] = a
        else:
            tail[lst] = a
        cnt[lst] -= 1
        t = tail[dst]
        pv[x] = t
        nx[x] = -1
        if t >= 0:
            nx[t] = x
        else:
            head[dst] = x
        tail[dst] = x
        cnt[dst] += 1
        w[x] = dst

    def _pop_lru(self, lst: int) -> int:
        """Take ``lst``'s LRU end out of it; return it."""
        pv, nx, head = self._pv, self._nx, self.head
        x = head[lst]
        b = nx[x]
        head[lst] = b
        if b >= 0:
            pv[b] = -1
        else:
            self.tail[lst] = -1
        self.count[lst] -= 1
        self._w[x] = 0
        return x

    def _demote(self, src: int, dst: int) -> int:
        """Move ``src``'s LRU end to ``dst``'s MRU end (a replacement: T1 -> B1 or T2 -> B2); return it."""
        y = self._pop_lru(src)
        pv, nx, tail = self._pv, self._nx, self.tail
        t = tail[dst]
        pv[y] = t
        nx[y] = -1
        if t >= 0:
            nx[t] = y
        else:
            self.head[dst] = y
        tail[dst] = y
        self.count[dst] += 1
        self._w[y] = dst
        return y

    def _replace(self, in_b2: bool, evicted: list[int]) -> None:
        n1 = self.count[_T1]
        if n1 and (n1 > self._p or (in_b2 and n1 == self._p)):
            b = self._demote(_T1, _B1)
        elif self.count[_T2]:
            b = self._demote(_T2, _B2)
        else:
            b = self._demote(_T1, _B1)
        evicted.append(b)

    def access(self, slots: list[int], evicted: list[int]) -> list[bool]:
        """Serve one request's slots in order; return the hit per slot; evicted slots go to ``evicted``.
        The list operations of the hit and miss paths are inlined (they run per block access)."""
        hits = [False] * len(slots)
        c = self.capacity_blocks
        if c == 0:
            return hits
        w, pv, nx = self._w, self._pv, self._nx
        head, tail, cnt = self.head, self.tail, self.count
        move, replace, pop_lru = self._move, self._replace, self._pop_lru
        for i, x in enumerate(slots):
            lst = w[x]
            if lst == _T2:
                if tail[_T2] != x:  # move_to_end (inlined _move within T2)
                    a, b = pv[x], nx[x]
                    if a >= 0:
                        nx[a] = b
                    else:
                        head[_T2] = b
                    pv[b] = a  # b >= 0: x is not the tail
                    t = tail[_T2]
                    pv[x] = t
                    nx[x] = -1
                    nx[t] = x  # t >= 0: T2 holds b
                    tail[_T2] = x
                hits[i] = True
            elif lst == _T1:
                move(x, _T2)
                hits[i] = True
            elif lst == _B1:
                self._p = min(float(c), self._p + max(cnt[_B2] / cnt[_B1], 1.0))
                if cnt[_T1] + cnt[_T2] >= c:
                    replace(False, evicted)
                move(x, _T2)
            elif lst == _B2:
                self._p = max(0.0, self._p - max(cnt[_B1] / cnt[_B2], 1.0))
                if cnt[_T1] + cnt[_T2] >= c:
                    replace(True, evicted)
                move(x, _T2)
            else:
                n1 = cnt[_T1]
                l1 = n1 + cnt[_B1]
                if l1 == c:
                    if n1 < c:
                        pop_lru(_B1)
                        if n1 + cnt[_T2] >= c:
                            replace(False, evicted)
                    else:
                        evicted.append(pop_lru(_T1))
                elif l1 < c:
                    n2 = cnt[_T2]
                    total = l1 + n2 + cnt[_B2]
                    if total >= c:
                        if total >= 2 * c:
                            pop_lru(_B2)
                        if n1 + n2 >= c:
                            replace(False, evicted)
                # append x to T1's MRU end (inlined _append)
                t = tail[_T1]
                pv[x] = t
                nx[x] = -1
                if t >= 0:
                    nx[t] = x
                else:
                    head[_T1] = x
                tail[_T1] = x
                cnt[_T1] += 1
                w[x] = _T1
        return hits
