"""Prefix-closed block cache driven by static keys: leaf-first heap eviction and bypass admission.

A key is ``z + t / (tau * mult)`` (z: predicted reuse log-odds at access, t: access time in s): the
current odds of return under an exponential age decay with time scale ``tau * mult``. Only resident
leaves are evictable, so a block never loses its parent while resident; admission of a request's
missing suffix stops at the first block that would itself be the next victim (bypass). Several
planners with different ``mult`` can shadow one another over the same stream; they share the block
table (parent, ids) of the owning policy and keep only their own residency, keys and heap.
"""

from __future__ import annotations

import heapq

import numpy as np
import numpy.typing as npt

_I64 = np.int64


class KeyedPlanner:
    """Residency + eviction state of one prefix-closed cache of ``capacity`` blocks."""

    def __init__(self, capacity: int, mult: float, size: int, heuristic: bool = False) -> None:
        self.capacity = capacity
        self.mult = mult
        # keyed by the fixed heuristic log-odds (the learned policy's fallback) instead of the model's
        self.heuristic = heuristic
        self.resident = np.zeros(size, dtype=bool)
        self.res_children = np.zeros(size, dtype=np.int32)
        self.key = np.zeros(size, dtype=np.float64)
        self.heap: list[tuple[float, int]] = []
        # lazy-deletion heap: rebuilt from the resident leaves once it holds twice as many entries as
        # after the last rebuild (bounds stale entries by the live ones, not by the capacity)
        self.heap_limit = 4096
        self.n_resident = 0
        self.n_lead = 0  # leading hits of the last request served (its prefix-hit blocks)
        self._views()

    def _views(self) -> None:
        self._v_res = self.resident.data
        self._v_rc = self.res_children.data
        self._v_key = self.key.data

    def grow(self, new: int) -> None:
        size = self.resident.shape[0]
        for name in ("resident", "res_children", "key"):
            old = getattr(self, name)
            arr = np.zeros(new, dtype=old.dtype)
            arr[:size] = old
            setattr(self, name, arr)
        self._views()

    def serve(
        self,
        slots: npt.NDArray[np.int64],
        keys: npt.NDArray[np.float64],
        parent: memoryview,
        on_evict: list[int] | None,
    ) -> npt.NDArray[np.bool_]:
        """Serve one request (``slots`` root first); return its hit mask; evicted slots go to ``on_evict``.

        Contract: each block admitted over capacity evicts the resident leaf with the smallest
        ``(key, slot)``, the newcomer included (then the rest of the request is bypassed). A slot listed
        twice keeps its last key. Every resident leaf has a live heap entry (so compaction never changes
        a decision): hit leaves and parents that become leaves are pushed, and so is an admitted block
        once it is known to stay a leaf (not when the request's next block becomes its child: that entry
        would only go stale)."""
        hit = self.resident[slots]
        karr = self.key
        karr[slots] = keys
        heap = self.heap
        res = self._v_res
        rc = self._v_rc
        sl = slots.tolist()
        kl = karr[slots].tolist() if len(sl) > 1 else keys.tolist()  # (a repeated slot: its last key)
        hl = hit.tolist()
        n = len(sl)
        n_hit = hl.index(False) if False in hl else n
        self.n_lead = n_hit
        push = heapq.heappush
        for i in range(n_hit):  # a hit leaf's key changed: push its new entry
            s = sl[i]
            if rc[s] == 0:
                push(heap, (kl[i], s))
        if n_hit < n and hl.count(True) > n_hit:  # hits past the first miss (not a root-first chain)
            for i in range(n_hit + 1, n):
                s = sl[i]
                if hl[i] and rc[s] == 0:
                    push(heap, (kl[i], s))
        if self.capacity <= 0 or n_hit == n:
            if len(heap) > self.heap_limit:  # all hits still push entries: bound the stale ones here too
                self.compact()
            return hit
        key = self._v_key
        pop = heapq.heappop
        n_res, cap = self.n_resident, self.capacity
        pend = -1  # the block admitted last, not pushed yet (index into sl)
        ck, cv = 0.0, -1  # the leaf the last eviction made (its parent), held out of the heap
        for i in range(n_hit, n):
            s = sl[i]
            p = parent[s]
            if res[s] or (p >= 0 and not res[p]):
                break  # keep the resident set prefix-closed
            res[s] = True
            n_res += 1
            if p >= 0:
                rc[p] += 1
                if p == cv:  # the held leaf got a child: no longer evictable
                    cv = -1
            if pend >= 0 and sl[pend] != p:  # the previous admission stays a leaf: it needs its entry
                push(heap, (kl[pend], sl[pend]))
                pend = -1
            if n_res <= cap:
                pend = i
                continue
            # the victim: the smallest (key, slot) of the newcomer, the held leaf and the heap's live top
            k, v = kl[i], s
            if cv >= 0 and (ck < k or (ck == k and cv < v)):
                k, v = ck, cv
            while heap:
                hk, hv = heap[0]
                if res[hv] and rc[hv] == 0 and key[hv] == hk:
                    if hk < k or (hk == k and hv < v):
                        pop(heap)
                        v = hv
                    break
                pop(heap)  # a stale entry
            if v == cv:
                cv = -1
            res[v] = False
            n_res -= 1
            pv = parent[v]
            if pv >= 0:
                rc[pv] -= 1
                if rc[pv] == 0 and res[pv]:  # a new leaf: often the next victim, so hold it
                    if cv >= 0:
                        push(heap, (ck, cv))
                    ck, cv = key[pv], pv
            if on_evict is not None:
                on_evict.append(v)
            if v == s:  # bypass: the newcomer is the least likely to return; skip the rest
                pend = -1  # its parent, if a leaf again, is the held one now
                break
            pend = i
        if pend >= 0:
            push(heap, (kl[pend], sl[pend]))
        if cv >= 0:
            push(heap, (ck, cv))
        self.n_resident = n_res
        if len(heap) > self.heap_limit:
            self.compact()
        return hit

    def copy(self) -> KeyedPlanner:
        """An independent copy (residency, keys, heap)."""
        out = KeyedPlanner.__new__(KeyedPlanner)
        out.capacity, out.mult, out.n_resident = self.capacity, self.mult, self.n_resident
        out.heuristic = self.heuristic
        out.n_lead = self.n_lead
        out.resident = self.resident.copy()
        out.res_children = self.res_children.copy()
        out.key = self.key.copy()
        out.heap = list(self.heap)
        out.heap_limit = self.heap_limit
        out._views()  # noqa: SLF001 - the same class: a copy rebuilds its own views
        return out

    def compact(self) -> None:
        """Rebuild the heap from the current resident leaves (drops stale entries)."""
        leaves = np.flatnonzero(self.resident & (self.res_children == 0))
        self.heap = list(zip(self.key[leaves].tolist(), leaves.tolist(), strict=True))
        heapq.heapify(self.heap)
        self.heap_limit = len(self.heap) + len(self.heap) // 4 + 4096  # stale entries: <= 25 % + 4096

    def rekey(
        self,
        z: npt.NDArray[np.float64],
        last_s: npt.NDArray[np.float64],
        tau_s: float,
        bias: npt.NDArray[np.float64] | None = None,
    ) -> None:
        """New keys for all slots from log-odds ``z`` and last access times ``last_s`` (per slot), plus an
        optional per-slot ``bias``."""
        n = z.shape[0]
        self.key[:n] = z + last_s / (tau_s * self.mult)
        if bias is not None:
            self.key[:n] += bias
        self.compact()

    def unbias(self, slots: npt.NDArray[np.int64], bias: float, exact: bool = False) -> None:
        """Take ``bias`` off the keys of the resident ones among ``slots`` whose key carries it (key >
        bias / 2, or all of them if ``exact``: the caller knows they carry it); evictable leaves
        re-enter the heap with their lower key."""
        s = slots[self.resident[slots]]
        if not exact:
            s = s[self.key[s] > bias / 2]
        if s.size == 0:
            return
        self.key[s] -= bias
        leaves = s[self.res_children[s] == 0]
        for k, v in zip(self.key[leaves].tolist(), leaves.tolist(), strict=True):
            heapq.heappush(self.heap, (k, v))
