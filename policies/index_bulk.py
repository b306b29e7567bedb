"""Vectorised bulk updates of a :class:`~kvtier.policies.index.BlockIndex` (pure, no I/O).

The KV-event hot path queues per-block operations and applies them here in one go, with numpy array
operations instead of one scalar numpy write per field per block. Semantics match calling the index's
``store`` / ``remove`` / ``touch`` one by one, with one documented relaxation: operations are applied in
*rounds* -- round k holds the k-th operation on each key (per-key order is kept exactly); operations on
different keys inside a window may be reordered across rounds. Counts (residency, children per tier,
access frequency) are order independent; a parent link is made if the parent is tracked by the end of its
round (the one-by-one path needs it tracked before the child's store).

Operation codes: STORE (key, parent key or None, tier rank, t ms), REMOVE (key, tier rank), TOUCH (key, t ms),
TOUCH_CHAIN (key, t ms: the key and every tracked ancestor are accessed). Keys are 64-bit hashes, signed or
unsigned. Falls back to the one-by-one path when ``max_blocks`` would force reclaiming.
"""

from __future__ import annotations

from operator import itemgetter

import numpy as np
import numpy.typing as npt

from kvtier.policies.index import BlockIndex, to_key

STORE, REMOVE, TOUCH, TOUCH_CHAIN = 0, 1, 2, 3
_EWMA_ALPHA = 0.3  # same as policies/index.py
_MAX_DEPTH = 4096

I64 = npt.NDArray[np.int64]


class OpQueue:
    """Queued operations: ``(op, key, parent_or_None, tier_rank, t_ms)`` tuples (one append each)."""

    __slots__ = ("ops",)

    def __init__(self) -> None:
        self.ops: list[tuple[int, int, int | None, int, float]] = []

    def __len__(self) -> int:
        return len(self.ops)

    def clear(self) -> None:
        self.ops.clear()


def _keys(vals: list[int]) -> I64:
    """u64 or i64 Python ints -> int64 keys (two's complement fold, as ``to_key``)."""
    try:
        return np.array(vals, dtype=np.uint64).view(np.int64)
    except OverflowError:  # negative (already folded) keys mixed in
        return np.array([to_key(v) for v in vals], dtype=np.int64)


def _unique_first(x: I64) -> tuple[I64, I64]:
    """Sorted unique values and the index of each one's first occurrence (sort based; numpy's hash-based
    ``np.unique`` was measured far slower on these arrays)."""
    o = np.argsort(x, kind="stable")
    xs = x[o]
    flag = np.empty(xs.size, dtype=np.bool_)
    if xs.size:
        flag[0] = True
        np.not_equal(xs[1:], xs[:-1], out=flag[1:])
    return xs[flag], o[flag]


def _touch(idx: BlockIndex, slots: I64, t: npt.NDArray[np.float64]) -> None:
    """Access ``slots`` at ``t``; duplicates are applied in order of appearance (rounds)."""
    while slots.size:
        uniq, first = _unique_first(slots)
        s, tt = uniq, t[first]
        seen = idx.freq[s] > 0
        if seen.any():
            ss, ts = s[seen], tt[seen]
            gap = (ts - idx.last_access[ss]).astype(np.float32)
            e = idx.gap_ewma[ss]
            idx.last_gap[ss] = gap
            idx.gap_ewma[ss] = np.where(np.isnan(e), gap, (1 - _EWMA_ALPHA) * e + _EWMA_ALPHA * gap)
        idx.freq[s] += 1
        idx.last_access[s] = tt
        if first.size == slots.size:
            return
        rest = np.ones(slots.size, dtype=np.bool_)
        rest[first] = False
        slots, t = slots[rest], t[rest]


def _allocate(idx: BlockIndex, new_keys: list[int], t_first: list[float]) -> bool:
    """Give each (distinct, untracked) int64 key a slot; False if ``max_blocks`` would need reclaiming."""
    n_new = len(new_keys)
    if not n_new:
        return True
    from_free = min(n_new, len(idx._free))
    fresh = n_new - from_free
    if idx.max_blocks is not None and idx._n + fresh > idx.max_blocks:
        return False
    while idx._n + fresh > idx.capacity:
        idx._grow()
    slots = [idx._free.pop() for _ in range(from_free)] + list(range(idx._n, idx._n + fresh))
    idx._n += fresh
    idx._slot.update(zip(new_keys, slots, strict=True))
    s = np.array(slots, dtype=np.int64)
    idx.hash[s] = np.array(new_keys, dtype=np.int64)
    idx.parent[s] = -1
    idx.depth[s] = 0
    idx.tiers[s] = 0
    idx.freq[s] = 1  # a store of an unseen block is its first access
    tf = np.array(t_first, dtype=np.float64)
    idx.first_seen[s] = tf
    idx.last_access[s] = tf
    idx.last_gap[s] = np.nan
    idx.gap_ewma[s] = np.nan
    idx.nbytes[s] = 0
    idx.n_children[s] = 0
    idx.res_children[s] = 0
    idx.used[s] = True
    return True


def _slow(idx: BlockIndex, q: OpQueue) -> None:
    for op, k, p, r, t in q.ops:
        if op == STORE:
            idx.store(k, p, r, 0, t)
        elif op == REMOVE:
            idx.remove(k, r)
        elif op == TOUCH:
            idx.touch(k, t)
        else:
            s = idx.slot_of(k)
            steps = 0
            while s >= 0 and steps < _MAX_DEPTH:
                idx.touch(idx.hash_of(s), t)
                s = int(idx.parent[s])
                steps += 1


def apply_ops(idx: BlockIndex, q: OpQueue) -> None:
    """Apply and clear the queued operations."""
    n = len(q)
    if not n:
        return
    ops = q.ops
    c_op, c_key, c_par, c_rank, c_t = (list(map(itemgetter(i), ops)) for i in range(5))
    op = np.array(c_op, dtype=np.int8)
    keys = _keys(c_key)
    ranks = np.array(c_rank, dtype=np.int64)
    ts = np.array(c_t, dtype=np.float64)
    # slots of tracked keys; untracked keys of STORE ops get new slots (time of their first store)
    slot = idx._slot
    slot_get = slot.get
    kl = keys.tolist()
    slots = np.array([slot_get(k, -1) for k in kl], dtype=np.int64)
    first_store: dict[int, int] = {}  # new key -> index of its first STORE
    miss = np.flatnonzero((slots < 0) & (op == STORE))
    if miss.size:
        mi = miss.tolist()
        first_store = dict(zip(reversed(keys[miss].tolist()), reversed(mi), strict=True))  # first wins
        new_keys = list(first_store)
        if not _allocate(idx, new_keys, ts[list(first_store.values())].tolist()):
            _slow(idx, q)
            q.clear()
            return
        neg = np.flatnonzero(slots < 0)  # incl. REMOVE/TOUCH of keys first stored in this window
        slots[neg] = [slot_get(k, -1) for k in keys[neg].tolist()]
    has_parent = np.array([p is not None for p in c_par], dtype=np.bool_)
    pslots = np.full(n, -1, dtype=np.int64)
    if has_parent.any():
        hp = np.flatnonzero(has_parent)
        pk = _keys([p for p in c_par if p is not None])
        # a chained store's parent is usually the previous op's key: reuse its slot, look up the rest
        prev = hp - 1
        chained = (prev >= 0) & (keys[np.maximum(prev, 0)] == pk)
        pslots[hp[chained]] = slots[prev[chained]]
        rest = ~chained
        if rest.any():
            pslots[hp[rest]] = [slot_get(k, -1) for k in pk[rest].tolist()]
    # rounds: the k-th op on each key goes to round k (TOUCH_CHAIN ops only touch, order-free)
    order = np.argsort(keys, kind="stable")
    sk = keys[order]
    starts = np.r_[0, np.flatnonzero(sk[1:] != sk[:-1]) + 1]
    occ_sorted = np.arange(n) - np.repeat(starts, np.diff(np.r_[starts, n]))
    occ = np.empty(n, dtype=np.int64)
    occ[order] = occ_sorted
    linked: list[I64] = []
    chain_s: list[I64] = []
    chain_t: list[npt.NDArray[np.float64]] = []
    is_store = op == STORE
    is_rm = (op == REMOVE) & (slots >= 0)
    n_rounds = int(occ.max()) + 1
    for rnd in range(n_rounds):
        m = occ == rnd if n_rounds > 1 else np.ones(n, dtype=np.bool_)
        # STORE: link (if unlinked), then set the tier bit
        st = np.flatnonzero(m & is_store)
        if st.size:
            s, p, r = slots[st], pslots[st], ranks[st]
            lk = (p >= 0) & (p != s) & (idx.parent[s] < 0)
            if lk.any():
                ls, lp = s[lk], p[lk]
                idx.parent[ls] = lp
                np.add.at(idx.n_children, lp, 1)
                bits = idx.tiers[ls]
                for tr in range(idx.res_children.shape[1]):
                    has = ((bits >> tr) & 1).astype(bool)
                    if has.any():
                        np.add.at(idx.res_children[:, tr], lp[has], 1)
                linked.append(ls)
            bit = (np.uint8(1) << r.astype(np.uint8)).astype(np.uint8)
            fresh = (idx.tiers[s] & bit) == 0
            if fresh.any():
                fs, fr = s[fresh], r[fresh]
                idx.tiers[fs] |= bit[fresh]
                par = idx.parent[fs]
                ok = par >= 0
                np.add.at(idx.res_children, (par[ok], fr[ok]), 1)
        # REMOVE: clear the tier bit
        rm = np.flatnonzero(m & is_rm)
        if rm.size:
            s, r = slots[rm], ranks[rm]
            bit = (np.uint8(1) << r.astype(np.uint8)).astype(np.uint8)
            was = (idx.tiers[s] & bit) != 0
            if was.any():
                ws, wr = s[was], r[was]
                idx.tiers[ws] &= ~bit[was]
                par = idx.parent[ws]
                ok = par >= 0
                np.subtract.at(idx.res_children, (par[ok], wr[ok]), 1)
    # accesses last, all sorted by time (they change statistics only, never residency or links); an access
    # to a key before its first store in this window is a no-op, as in the one-by-one path
    is_t = (op == TOUCH) | (op == TOUCH_CHAIN)
    if first_store and is_t.any():
        ti = np.flatnonzero(is_t)
        fget = first_store.get
        fs = np.array([fget(kl[i], -1) for i in ti.tolist()], dtype=np.int64)
        is_t[ti[(fs >= 0) & (fs > ti)]] = False
    tc = np.flatnonzero(is_t & (op == TOUCH) & (slots >= 0))
    if tc.size:
        chain_s.append(slots[tc])
        chain_t.append(ts[tc])
    ch = np.flatnonzero(is_t & (op == TOUCH_CHAIN) & (slots >= 0))
    if ch.size:
        cur, ct = slots[ch], ts[ch]
        for _ in range(_MAX_DEPTH):
            chain_s.append(cur)
            chain_t.append(ct)
            nxt = idx.parent[cur].astype(np.int64)
            ok = nxt >= 0
            if not ok.any():
                break
            cur, ct = nxt[ok], ct[ok]
    if chain_s:  # order by time so repeated accesses of one block apply oldest first
        s_all, t_all = np.concatenate(chain_s), np.concatenate(chain_t)
        o = np.argsort(t_all, kind="stable")
        _touch(idx, s_all[o], t_all[o])
    # depth of newly linked blocks = parent depth + 1; chains linked in the same window are resolved by
    # pointer jumping (log2(chain length) vector steps): depth[w] = add[w] + depth[ptr[w]], ptr outside W
    if linked:
        ls = _unique_first(np.concatenate(linked))[0]
        pos = np.full(idx.capacity, -1, dtype=np.int64)
        pos[ls] = np.arange(ls.size)
        ptr = idx.parent[ls].astype(np.int64)
        add = np.ones(ls.size, dtype=np.int64)
        for _ in range(64):
            pw = pos[ptr]
            inner = pw >= 0
            if not inner.any():
                break
            j = pw[inner]
            add[inner] += add[j]
            ptr[inner] = ptr[j]
        idx.depth[ls] = (add + idx.depth[ptr]).astype(idx.depth.dtype)
    q.clear()
