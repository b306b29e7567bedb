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
unsigned. Under ``max_blocks``, room is reclaimed in bulk before a window is applied (:func:`apply_ops`).
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import numpy.typing as npt

from kvtier.policies.index import BlockIndex, IndexFullError, to_key

STORE, REMOVE, TOUCH, TOUCH_CHAIN = 0, 1, 2, 3
_STORE_P, _STORE_C = 4, 5  # internal: STORE with a parent key in OpQueue.pkey / with the previous op's key
_EWMA_ALPHA = 0.3  # same as policies/index.py
_MAX_DEPTH = 4096

I64 = npt.NDArray[np.int64]


class OpQueue:
    """Queued index operations, in order.

    Two ways in: ``ops`` holds ``(op, key, parent_or_None, tier_rank, t_ms)`` tuples (simple, one append
    each); the column methods (:meth:`add`, :meth:`add_many`, :meth:`store_chain`) are the fast path used by
    the KV-event ingestor (a whole chain or run of removals per call, no tuple per block). :func:`apply_ops`
    applies the columns first, then the tuples -- use one interface per queue.
    """

    __slots__ = ("ops", "key", "segs", "pkey")

    def __init__(self) -> None:
        self.ops: list[tuple[int, int, int | None, int, float]] = []
        self.key: list[int] = []  # 64-bit keys, signed or unsigned, one per operation
        # runs of operations with one code and time: (index of the run's first op, op | rank << 3, t ms);
        # op is STORE .. TOUCH_CHAIN, _STORE_P (parent in pkey) or _STORE_C (parent = the previous op's key)
        self.segs: list[tuple[int, int, float]] = []
        self.pkey: list[int] = []  # parent keys of the _STORE_P ops, in order

    def __len__(self) -> int:
        return len(self.key) + len(self.ops)

    def clear(self) -> None:
        self.ops.clear()
        self.key.clear()
        self.segs.clear()
        self.pkey.clear()

    def add(self, op: int, key: int, parent: int | None, rank: int, t: float) -> None:
        """One operation (``parent`` only for STORE)."""
        if op == STORE and parent is not None:
            op = _STORE_P
            self.pkey.append(parent)
        self.segs.append((len(self.key), op | rank << 3, t))
        self.key.append(key)

    def add_many(self, op: int, keys: list[int], rank: int, t: float) -> None:
        """One REMOVE / TOUCH / TOUCH_CHAIN (or parentless STORE) for each of ``keys``, in order."""
        self.segs.append((len(self.key), op | rank << 3, t))
        self.key += keys

    def store_chain(self, keys: list[int], parent: int | None, rank: int, t: float) -> None:
        """STORE ``keys`` in order, each the child of the previous one (``keys[0]`` that of ``parent``)."""
        if not keys:
            return
        c = rank << 3
        i = len(self.key)
        if parent is None:
            self.segs.append((i, STORE | c, t))
        else:
            self.segs.append((i, _STORE_P | c, t))
            self.pkey.append(parent)
        if len(keys) > 1:
            self.segs.append((i + 1, _STORE_C | c, t))
        self.key += keys

    def columns(self) -> tuple[npt.NDArray[np.int8], npt.NDArray[np.float64]]:
        """Per-operation code (op | rank << 3) and time (ms) arrays of the column ops."""
        n = len(self.key)
        if not self.segs:
            return np.empty(0, dtype=np.int8), np.empty(0, dtype=np.float64)
        # one C-level pass over the flattened (start, code, t) runs; starts and codes are far below 2**53,
        # so float64 holds them exactly (a zip(*segs) of ~10^5 tuples was most of a flush's cost)
        m = len(self.segs)
        flat = np.fromiter(chain.from_iterable(self.segs), dtype=np.float64, count=3 * m).reshape(m, 3)
        st = flat[:, 0].astype(np.int64)
        ln = np.diff(st, append=n)
        code, t = flat[:, 1], flat[:, 2]
        keep = ln > 0  # an empty run (add_many of no keys) must not shift the others
        if not keep.all():
            ln, code, t = ln[keep], code[keep], t[keep]
        return np.repeat(code.astype(np.int8), ln), np.repeat(t, ln)

    def tuples(self) -> list[tuple[int, int, int | None, int, float]]:
        """Every queued operation as ``(op, key, parent_or_None, tier_rank, t_ms)``, in apply order."""
        out: list[tuple[int, int, int | None, int, float]] = []
        pk = iter(self.pkey)
        prev: int | None = None
        codes, ts = self.columns()
        for c, k, t in zip(codes.tolist(), self.key, ts.tolist(), strict=True):
            op, r = c & 7, c >> 3
            if op == _STORE_P:
                out.append((STORE, k, next(pk), r, t))
            elif op == _STORE_C:
                out.append((STORE, k, prev, r, t))
            else:
                out.append((op, k, None, r, t))
            prev = k
        return out + self.ops

    def spill_tuples(self) -> None:
        """Move the tuple ops into the columns (after the column ops)."""
        for op, k, p, r, t in self.ops:
            self.add(op, k, p, r, t)
        self.ops.clear()


def _keys(vals: list[int]) -> I64:
    """u64 or i64 Python ints -> int64 keys (two's complement fold, as ``to_key``)."""
    try:
        return np.fromiter(vals, dtype=np.uint64, count=len(vals)).view(np.int64)
    except OverflowError:  # negative (already folded) keys mixed in
        return np.array([to_key(v) for v in vals], dtype=np.int64)


def stable_argsort(x: I64) -> I64:
    """``np.argsort(x, kind="stable")`` for int64 ``x``: numpy's unstable (SIMD) argsort, then ties put back
    in index order by a second unstable sort of (rank of the value, index) -- unique, so stable. On keys with
    repeats, 1.5-1.9x the speed of numpy's stable int64 sort from 16k to 1M keys, but 0.6-0.7x at 1k
    (``python -m bench.stable_argsort``, two runs on a shared 2-core machine)."""
    o = np.argsort(x)
    n = x.size
    if n < 2:
        return o
    xs = x[o]
    tie = xs[1:] == xs[:-1]
    if not tie.any():
        return o
    rank = np.empty(n, dtype=np.int64)
    rank[0] = 0
    np.cumsum(~tie, out=rank[1:])
    rank *= n
    rank += o
    return o[np.argsort(rank)]


def _unique_first(x: I64) -> tuple[I64, I64]:
    """Sorted unique values and the index of each one's first occurrence (sort based; numpy's hash-based
    ``np.unique`` was measured far slower on these arrays)."""
    o = stable_argsort(x)
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


def _count_add(a: npt.NDArray[np.int32], i: I64, delta: int) -> None:
    """``a[i] += delta`` with repeated indices accumulating (as ``np.add.at``, faster)."""
    if i.size == 0:
        return
    if i.size <= 32:
        np.add.at(a, i, delta)
        return
    lo, hi = int(i.min()), int(i.max())
    if hi - lo <= 8 * i.size + 4096:  # compact range (new slots are mostly contiguous): count directly
        cnt = np.bincount(i - lo, minlength=hi - lo + 1)
        a[lo : hi + 1] += (cnt * delta).astype(a.dtype)
        return
    u, c = np.unique(i, return_counts=True)
    a[u] += (c * delta).astype(a.dtype)


def _lookup(idx: BlockIndex, keys: I64) -> I64:
    """Slots of int64 ``keys`` (-1 = untracked)."""
    return idx.slots_of_keys(keys)


def _allocate(
    idx: BlockIndex, keys: I64, t_first: npt.NDArray[np.float64]
) -> tuple[I64, npt.NDArray[np.bool_]]:
    """Slots of the distinct int64 ``keys``; untracked ones get a new slot, first seen (and accessed) at
    ``t_first`` (ms). Returns (slots, which ones are new). Under ``max_blocks`` the caller made room first
    (:meth:`BlockIndex.make_room`).

    One vectorised lookup + insert for all keys (a ``setdefault`` with a candidate slot each); unused
    candidates go back to the free list."""
    got, is_new = idx.get_or_allocate_slots(keys)
    s = got[is_new]
    if s.size:
        idx.hash[s] = keys[is_new]
        idx.parent[s] = -1
        idx.depth[s] = 0
        idx.tiers[s] = 0
        idx.freq[s] = 1  # a store of an unseen block is its first access
        tf = t_first[is_new]
        idx.first_seen[s] = tf
        idx.last_access[s] = tf
        idx.last_gap[s] = np.nan
        idx.gap_ewma[s] = np.nan
        changed = s[idx.nbytes[s] != 0]
        idx.nbytes[s] = 0
        if changed.size:
            idx.note_nbytes_changed(changed)
        idx.n_children[s] = 0
        idx.res_children[s] = 0
        idx.used[s] = True
    return got, is_new


def _slow(idx: BlockIndex, q: OpQueue) -> int:
    """Apply one by one; a STORE that finds the index full (nothing reclaimable) is skipped. Returns the
    number of operations skipped."""
    skipped = 0
    for op, k, p, r, t in q.tuples():
        if op == STORE:
            try:
                idx.store(k, p, r, 0, t)
            except IndexFullError:
                skipped += 1
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
    return skipped


def _first_flags(x: I64) -> npt.NDArray[np.bool_]:
    """True where a sorted array starts a new value."""
    f = np.empty(x.size, dtype=np.bool_)
    if x.size:
        f[0] = True
        np.not_equal(x[1:], x[:-1], out=f[1:])
    return f


def apply_ops(idx: BlockIndex, q: OpQueue) -> int:
    """Apply and clear the queued operations. Under ``max_blocks``, room for this window's new blocks is
    reclaimed first (the stalest blocks resident nowhere and without children, in bulk); when not enough
    can be, the window goes one by one and the STOREs that still do not fit are skipped. Returns the number
    of operations skipped (0 unless the index is full of resident blocks or blocks with children)."""
    if q.ops:
        q.spill_tuples()
    n = len(q.key)
    if not n:
        return 0
    codes, ts = q.columns()
    op = codes & 7
    ranks = (codes >> 3).astype(np.int64)
    keys = _keys(q.key)
    # distinct keys (sort based); each op's key group and occurrence number on its key (= its round)
    order = stable_argsort(keys)
    sk = keys[order]
    flag = _first_flags(sk)
    gs = np.cumsum(flag) - 1  # group of each sorted position
    uk = sk[flag]
    starts = np.flatnonzero(flag)
    inv = np.empty(n, dtype=np.int64)
    inv[order] = gs
    occ = np.empty(n, dtype=np.int64)
    occ[order] = np.arange(n) - starts[gs]
    is_store = (op == STORE) | (op >= _STORE_P)
    # the first STORE on each key (sorted order is stable: earliest op first within a group)
    sp = np.flatnonzero(is_store[order])
    g = gs[sp]
    fm = _first_flags(g)
    st_g, st_i = g[fm], order[sp[fm]]
    if idx.max_blocks is not None and st_g.size:
        try:  # before any lookup: reclaiming frees slots (a key looked up afterwards is simply untracked)
            idx.make_room(st_g.size)
        except IndexFullError:
            skipped = _slow(idx, q)
            q.clear()
            return skipped
    uslot = np.full(uk.size, -1, dtype=np.int64)
    lone = np.ones(uk.size, dtype=np.bool_)
    lone[st_g] = False
    ns = np.flatnonzero(lone)  # keys only removed / touched here: look up, never allocate
    if ns.size:
        uslot[ns] = _lookup(idx, uk[ns])
    first_new = np.full(uk.size, -1, dtype=np.int64)  # op index of the first STORE of a newly tracked key
    if st_g.size:
        got = _allocate(idx, uk[st_g], ts[st_i])
        uslot[st_g] = got[0]
        first_new[st_g[got[1]]] = st_i[got[1]]
    slots = uslot[inv]
    pslots = np.full(n, -1, dtype=np.int64)
    sc = np.flatnonzero(op == _STORE_C)  # chained store: parent = the previous op's key (stored -> slot)
    if sc.size:
        pslots[sc] = slots[sc - 1]
    spp = np.flatnonzero(op == _STORE_P)
    if spp.size:
        pslots[spp] = _lookup(idx, _keys(q.pkey))
    linked: list[I64] = []
    chain_s: list[I64] = []
    chain_t: list[npt.NDArray[np.float64]] = []
    is_rm = (op == REMOVE) & (slots >= 0)
    n_rounds = int(occ.max()) + 1
    rc_flat = idx.res_children.reshape(-1)  # a view: (slot, rank) -> slot * n_tiers + rank
    n_tiers = idx.res_children.shape[1]
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
                _count_add(idx.n_children, lp, 1)
                bits = idx.tiers[ls]
                if bits.any():
                    for tr in range(n_tiers):
                        has = ((bits >> tr) & 1).astype(bool)
                        if has.any():
                            _count_add(rc_flat, lp[has] * n_tiers + tr, 1)
                linked.append(ls)
            bit = (np.uint8(1) << r.astype(np.uint8)).astype(np.uint8)
            fresh = (idx.tiers[s] & bit) == 0
            if fresh.any():
                fs, fr = s[fresh], r[fresh]
                idx.tiers[fs] |= bit[fresh]
                par = idx.parent[fs].astype(np.int64)
                ok = par >= 0
                _count_add(rc_flat, par[ok] * n_tiers + fr[ok], 1)
        # REMOVE: clear the tier bit
        rm = np.flatnonzero(m & is_rm)
        if rm.size:
            s, r = slots[rm], ranks[rm]
            bit = (np.uint8(1) << r.astype(np.uint8)).astype(np.uint8)
            was = (idx.tiers[s] & bit) != 0
            if was.any():
                ws, wr = s[was], r[was]
                idx.tiers[ws] &= ~bit[was]
                par = idx.parent[ws].astype(np.int64)
                ok = par >= 0
                _count_add(rc_flat, par[ok] * n_tiers + wr[ok], -1)
    # accesses last, all sorted by time (they change statistics only, never residency or links); an access
    # to a key before its first store in this window is a no-op, as in the one-by-one path
    is_t = ((op == TOUCH) | (op == TOUCH_CHAIN)) & (slots >= 0)
    ti = np.flatnonzero(is_t)
    if ti.size:
        is_t[ti[first_new[inv[ti]] > ti]] = False
    tc = np.flatnonzero(is_t & (op == TOUCH))
    if tc.size:
        chain_s.append(slots[tc])
        chain_t.append(ts[tc])
    ch = np.flatnonzero(is_t & (op == TOUCH_CHAIN))
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
        o = np.argsort(t_all)  # ties: the same time, so their order changes nothing
        _touch(idx, s_all[o], t_all[o])
    # depth of newly linked blocks = parent depth + 1; chains linked in the same window are resolved by
    # pointer jumping (log2(chain length) vector steps): depth[w] = add[w] + depth[ptr[w]], ptr outside W
    if linked:
        ls = np.concatenate(linked)  # distinct: a slot is linked at most once
        ptr = idx.parent[ls].astype(np.int64)
        add = np.ones(ls.size, dtype=np.int64)
        lo, hi = int(ls.min()), int(ls.max())
        if hi - lo < 8 * ls.size + 1024:  # new slots are mostly contiguous: a dense position table
            pos = np.full(hi - lo + 1, -1, dtype=np.int64)
            pos[ls - lo] = np.arange(ls.size)

            def where(x: I64) -> I64:
                inside = (x >= lo) & (x <= hi)
                out = np.full(x.size, -1, dtype=np.int64)
                out[inside] = pos[x[inside] - lo]
                return out
        else:
            srt = np.argsort(ls)
            sl = ls[srt]

            def where(x: I64) -> I64:
                i = np.minimum(np.searchsorted(sl, x), sl.size - 1)
                return np.where(sl[i] == x, srt[i], -1)

        for _ in range(64):
            pw = where(ptr)
            inner = pw >= 0
            if not inner.any():
                break
            j = pw[inner]
            add[inner] += add[j]
            ptr[inner] = ptr[j]
        idx.depth[ls] = (add + idx.depth[ptr]).astype(idx.depth.dtype)
    q.clear()
    return 0
