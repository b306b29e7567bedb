"""Compact int64 -> int64 hash map on numpy arrays (open addressing, linear probing).

A replacement for ``dict[int, int]`` where millions of entries would cost ~110 bytes each as Python
objects: here an entry costs 16 bytes per bucket at a load factor of at most ``MAX_LOAD`` (about 23-46
bytes per entry). Vectorised lookups (:meth:`SlotMap.get_many`) take one numpy pass per probe round, so
looking up 100k keys costs a few milliseconds instead of 100k Python calls. Scalar operations stay
available (``get`` / ``put`` / ``pop``) for the per-block paths. Deletion is backward-shift (no
tombstones), so lookups never degrade. Keys are any int64; values any int64 except ``EMPTY``.
Pure, no I/O; deterministic (no per-process hash seed).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator

import numpy as np
import numpy.typing as npt

EMPTY = np.iinfo(np.int64).min  # value of a free bucket (cannot be stored)
MAX_LOAD = 0.5
_SCALAR_TAIL = 32  # vectorised probing hands the last few keys of a long probe run to the scalar path
_SCALAR_MAX = 256  # below this many keys, scalar probing beats the vectorised path's fixed cost per call
_GOLD = 0x9E3779B97F4A7C15  # Fibonacci hashing multiplier (2**64 / golden ratio)
_M64 = (1 << 64) - 1


class SlotMap:
    """``int64 key -> int64 value`` map; ``get`` returns ``default`` (-1) for a missing key."""

    def __init__(self, capacity: int = 1024) -> None:
        bits = 4
        while (1 << bits) * MAX_LOAD < capacity:
            bits += 1
        self._alloc(bits)
        self._n = 0

    def _alloc(self, bits: int) -> None:
        self._bits = bits
        self._shift = 64 - bits
        self._mask = (1 << bits) - 1
        self._limit = int((1 << bits) * MAX_LOAD)
        # bucket b: key at [b, 0], value at [b, 1] (one cache line per probe)
        self._tab = np.zeros((1 << bits, 2), dtype=np.int64)
        self._tab[:, 1] = EMPTY
        self._keys = self._tab[:, 0]
        self._vals = self._tab[:, 1]
        self._mv = self._tab.reshape(-1).data  # flat memoryview: fast scalar access from Python

    # -- sizes -------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return self._n

    @property
    def buckets(self) -> int:
        """Table size in buckets (a power of two); it holds at most ``MAX_LOAD`` x that many entries."""
        return 1 << self._bits

    @property
    def nbytes(self) -> int:
        """Bytes held by the table arrays."""
        return int(self._tab.nbytes)

    def _home(self, key: int) -> int:
        return ((key * _GOLD) & _M64) >> self._shift

    def _homes(self, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        h = keys.view(np.uint64) * np.uint64(_GOLD)  # wraps mod 2**64, like the scalar path
        h >>= np.uint64(self._shift)
        return h.view(np.int64)

    # -- scalar operations -------------------------------------------------------------------------------
    def get(self, key: int, default: int = -1) -> int:
        """Value of ``key`` (a Python int in int64 range), or ``default``."""
        key = int(key)
        mv, m = self._mv, self._mask
        i = ((key * _GOLD) & _M64) >> self._shift
        while True:
            v = mv[2 * i + 1]
            if v == EMPTY:
                return default
            if mv[2 * i] == key:
                return v
            i = (i + 1) & m

    def get_list(self, keys: list[int], default: int = -1) -> list[int]:
        """Values of a list of keys (``default`` where absent): scalar probing for up to ``_SCALAR_MAX``
        keys, where it beats the vectorised path's fixed per-call cost."""
        if len(keys) > _SCALAR_MAX:
            return self.get_many(np.asarray(keys, dtype=np.int64), default).tolist()
        mv, m, shift = self._mv, self._mask, self._shift
        out: list[int] = []
        put = out.append
        for k in keys:
            i = ((k * _GOLD) & _M64) >> shift
            while True:
                v = mv[2 * i + 1]
                if v == EMPTY:
                    put(default)
                    break
                if mv[2 * i] == k:
                    put(v)
                    break
                i = (i + 1) & m
        return out

    def get_or_assign(self, keys: list[int], first: int) -> tuple[list[int], int]:
        """Value of each key (Python ints in int64 range), in one probing pass: an absent key is inserted
        with the next value counting up from ``first`` (so a key repeated later in ``keys`` finds the
        value it was just given). Returns the values and how many keys were inserted."""
        self.reserve(len(keys))  # no rehash in the middle of the pass
        mv, m, shift = self._mv, self._mask, self._shift
        out: list[int] = []
        put = out.append
        nxt = first
        for k in keys:
            i = ((k * _GOLD) & _M64) >> shift
            while True:
                v = mv[2 * i + 1]
                if v == EMPTY:
                    mv[2 * i] = k
                    mv[2 * i + 1] = nxt
                    put(nxt)
                    nxt += 1
                    break
                if mv[2 * i] == k:
                    put(v)
                    break
                i = (i + 1) & m
        self._n += nxt - first
        return out, nxt - first

    def __getitem__(self, key: int) -> int:
        """Value of ``key``; KeyError if absent (dict-like)."""
        v = self.get(key, EMPTY)
        if v == EMPTY:
            raise KeyError(key)
        return v

    def __iter__(self) -> Iterator[int]:
        """Keys (table order; a snapshot)."""
        return iter(self.items()[0].tolist())

    def __contains__(self, key: object) -> bool:
        return isinstance(key, int) and self.get(key, EMPTY) != EMPTY

    def put(self, key: int, value: int) -> None:
        """Insert or overwrite ``key``."""
        if value == EMPTY:
            raise ValueError("SlotMap cannot store its EMPTY sentinel as a value")
        key, value = int(key), int(value)
        mv, m = self._mv, self._mask
        i = ((key * _GOLD) & _M64) >> self._shift
        while True:
            v = mv[2 * i + 1]
            if v == EMPTY:
                break
            if mv[2 * i] == key:
                mv[2 * i + 1] = value
                return
            i = (i + 1) & m
        mv[2 * i] = key
        mv[2 * i + 1] = value
        self._n += 1
        if self._n > self._limit:
            self._rehash(self._bits + 1)

    def put_list(self, keys: list[int], values: list[int]) -> None:
        """Sequential :meth:`put` of Python ints (int64 range), inlined for the per-request path."""
        if len(keys) != len(values):
            raise ValueError("keys and values differ in length")
        mv, m, shift = self._mv, self._mask, self._shift
        for key, value in zip(keys, values, strict=True):
            if value == EMPTY:
                raise ValueError("SlotMap cannot store its EMPTY sentinel as a value")
            i = ((key * _GOLD) & _M64) >> shift
            while True:
                v = mv[2 * i + 1]
                if v == EMPTY:
                    mv[2 * i] = key
                    mv[2 * i + 1] = value
                    self._n += 1
                    if self._n > self._limit:
                        self._rehash(self._bits + 1)
                        mv, m, shift = self._mv, self._mask, self._shift
                    break
                if mv[2 * i] == key:
                    mv[2 * i + 1] = value
                    break
                i = (i + 1) & m

    def pop(self, key: int, default: int = -1) -> int:
        """Remove ``key``; its value, or ``default`` if absent (backward-shift deletion)."""
        key = int(key)
        mv, m = self._mv, self._mask
        shift = self._shift
        i = ((key * _GOLD) & _M64) >> shift
        while True:
            v = mv[2 * i + 1]
            if v == EMPTY:
                return default
            if mv[2 * i] == key:
                break
            i = (i + 1) & m
        out = v
        j = i
        while True:  # shift later members of the probe run back over the hole
            j = (j + 1) & m
            vj = mv[2 * j + 1]
            if vj == EMPTY:
                break
            kj = mv[2 * j]
            h = ((kj * _GOLD) & _M64) >> shift
            # the entry at j may move to the hole i unless its home lies cyclically in (i, j]
            if (i <= j and (h <= i or h > j)) or (i > j and h <= i and h > j):
                mv[2 * i] = kj
                mv[2 * i + 1] = vj
                i = j
        mv[2 * i + 1] = EMPTY
        self._n -= 1
        return out

    def clear(self) -> None:
        self._vals[:] = EMPTY
        self._n = 0

    # -- vectorised operations ---------------------------------------------------------------------------
    def _find(self, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Bucket of each key, or -1 where absent (one numpy pass per probe round)."""
        n = keys.shape[0]
        out = np.full(n, -1, dtype=np.int64)
        if n == 0 or self._n == 0:
            return out
        tab, m = self._tab, self._mask
        pos = self._homes(keys)
        g = np.take(tab, pos, axis=0)
        live = g[:, 1] != EMPTY
        hit = live & (g[:, 0] == keys)
        out[hit] = pos[hit]
        act = np.flatnonzero(live & ~hit)
        pos = (pos[act] + 1) & m
        kk = keys[act]
        while act.size > _SCALAR_TAIL:
            g = np.take(tab, pos, axis=0)
            live = g[:, 1] != EMPTY
            hit = live & (g[:, 0] == kk)
            out[act[hit]] = pos[hit]
            go = live & ~hit
            act, pos, kk = act[go], (pos[go] + 1) & m, kk[go]
        if act.size:
            mv = self._mv
            for a, i, k in zip(act.tolist(), pos.tolist(), kk.tolist(), strict=True):
                while True:
                    if mv[2 * i + 1] == EMPTY:
                        break
                    if mv[2 * i] == k:
                        out[a] = i
                        break
                    i = (i + 1) & m
        return out

    def get_many(self, keys: npt.ArrayLike, default: int = -1) -> npt.NDArray[np.int64]:
        """Values of ``keys`` (int64 array), ``default`` where absent."""
        k = np.ascontiguousarray(keys, dtype=np.int64).ravel()
        if k.shape[0] <= _SCALAR_MAX:
            return np.array(self.get_list(k.tolist(), default), dtype=np.int64)
        b = self._find(k)
        out = np.full(k.shape[0], default, dtype=np.int64)
        ok = b >= 0
        out[ok] = self._vals[b[ok]]
        return out

    def put_many(self, keys: npt.ArrayLike, values: npt.ArrayLike) -> None:
        """Insert / overwrite many; with repeated keys the last value wins (like sequential puts)."""
        if isinstance(keys, np.ndarray) and isinstance(values, np.ndarray) and keys.size <= _SCALAR_MAX:
            # a few keys: scalar puts beat the vectorised path's fixed cost
            self.put_list(keys.tolist(), values.tolist())
            return
        k = np.ascontiguousarray(keys, dtype=np.int64).ravel()
        v = np.ascontiguousarray(np.broadcast_to(np.asarray(values, dtype=np.int64), k.shape))
        if k.size == 0:
            return
        if (v == EMPTY).any():
            raise ValueError("SlotMap cannot store its EMPTY sentinel as a value")
        uk, first_rev = np.unique(k[::-1], return_index=True)
        if uk.size < k.size:  # repeated keys: keep each one's last value, in first-seen order
            last = k.size - 1 - first_rev
            last.sort()
            k, v = k[last], v[last]
        b = self._find(k)
        old = b >= 0
        self._vals[b[old]] = v[old]
        new = ~old
        if not new.any():
            return
        self.get_or_put(k[new], v[new])

    def get_or_put(self, keys: npt.NDArray[np.int64], values: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """For distinct ``keys``: each one's value if present, else insert ``values[i]`` and return it. One
        probing pass for both (a present key is met before any free bucket on its probe run). Each round,
        every pending key looks at its current bucket; of the keys reaching one free bucket the last one
        scattered takes it (no sort: a free bucket's key cell is scratch, freeness is the value column), the
        rest probe on; the last few keys of long probe runs go the scalar way."""
        k = np.ascontiguousarray(keys, dtype=np.int64).ravel()
        v = np.ascontiguousarray(values, dtype=np.int64).ravel()
        if k.shape != v.shape:
            raise ValueError("keys and values differ in length")
        if k.size == 0:
            return v.copy()
        if (v == EMPTY).any():
            raise ValueError("SlotMap cannot store its EMPTY sentinel as a value")
        self.reserve(k.shape[0])
        ks, vs, m = self._keys, self._vals, self._mask
        out = v.copy()
        act = np.arange(k.shape[0], dtype=np.int64)
        pos = self._homes(k)
        added = 0
        while act.size > _SCALAR_TAIL:
            bv = vs[pos]
            free = bv == EMPTY
            done = ~free
            done &= ks[pos] == k[act]  # present: keep its value
            hit = np.flatnonzero(done)
            if hit.size:
                out[act[hit]] = bv[hit]
            fi = np.flatnonzero(free)
            if fi.size:  # the last key scattered onto a free bucket takes it (its key cell is scratch)
                p = pos[fi]
                ks[p] = fi
                w = fi[ks[p] == fi]
                ks[pos[w]] = k[act[w]]
                vs[pos[w]] = v[act[w]]
                done[w] = True
                added += w.size
            keep = ~done
            act, pos = act[keep], (pos[keep] + 1) & m
        if act.size:
            mv = self._mv
            for a, i, key in zip(act.tolist(), pos.tolist(), k[act].tolist(), strict=True):
                while True:
                    b = mv[2 * i + 1]
                    if b == EMPTY:
                        mv[2 * i] = key
                        mv[2 * i + 1] = int(out[a])
                        added += 1
                        break
                    if mv[2 * i] == key:
                        out[a] = b
                        break
                    i = (i + 1) & m
        self._n += added
        return out

    def reserve(self, extra: int) -> None:
        """Grow the table (one rehash) so ``extra`` more entries stay within ``MAX_LOAD``; nothing if they
        already do. Entries and lookups are unchanged."""
        bits = self._bits
        while int((1 << bits) * MAX_LOAD) < self._n + extra:
            bits += 1
        if bits != self._bits:
            self._rehash(bits)

    def _rehash(self, bits: int) -> None:
        live = self._vals != EMPTY
        k, v = self._keys[live], self._vals[live]
        self._alloc(bits)
        self._n = 0
        self._place_sorted(k, v)

    def _place_sorted(self, keys: npt.NDArray[np.int64], vals: npt.NDArray[np.int64]) -> None:
        """Insert distinct keys into an empty table in one pass: in order of home bucket, each key takes
        ``max(its home, the previous key's bucket + 1)`` -- a valid linear-probing layout (every bucket
        between a key's home and its bucket is taken). Keys pushed past the last bucket wrap around (scalar).
        The table's old order is nearly sorted by the new homes, so the stable sort is close to linear."""
        n = keys.shape[0]
        if n == 0:
            return
        h = self._homes(keys)
        o = np.argsort(h, kind="stable")
        hs = h[o]
        i = np.arange(n, dtype=np.int64)
        p = np.maximum.accumulate(hs - i) + i
        cut = int(np.searchsorted(p, self._mask + 1))  # p increases: keys from cut on ran off the end
        ko, vo = keys[o], vals[o]
        self._keys[p[:cut]] = ko[:cut]
        self._vals[p[:cut]] = vo[:cut]
        if cut < n:
            mv, m = self._mv, self._mask
            for key, value in zip(ko[cut:].tolist(), vo[cut:].tolist(), strict=True):
                j = ((key * _GOLD) & _M64) >> self._shift
                while mv[2 * j + 1] != EMPTY:
                    j = (j + 1) & m
                mv[2 * j] = key
                mv[2 * j + 1] = value
        self._n += n

    def items(self) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """(keys, values) of all entries (table order)."""
        live = self._vals != EMPTY
        return self._keys[live], self._vals[live]


def grown_size(size: int, need: int) -> int:
    """New length of a per-slot array of ``size`` entries that must hold ``need``: doubling while small,
    then +25 % (amortised O(1) growth; at most ~20 % unused slack once large, instead of up to 50 %)."""
    return max(need, 1024, 2 * size if size < 65_536 else size + size // 4)


class LogitCache:
    """Per-slot memo of a value computed from the slot's last access event (e.g. a model's log-odds).

    An entry is valid while the slot's event id is unchanged and the ``version`` given with the lookup
    equals the one it was computed under (pass the model's identity / refit count). Memory: 16 bytes
    per slot (float64 value + int64 event id)."""

    def __init__(self) -> None:
        self._val = np.zeros(0, dtype=np.float64)
        self._ev = np.zeros(0, dtype=np.int64)
        self._version: Hashable = None

    def get(
        self,
        slots: npt.NDArray[np.int64],
        events: npt.NDArray[np.int64],
        version: Hashable,
        compute: Callable[[npt.NDArray[np.int64]], npt.NDArray[np.float64]],
    ) -> npt.NDArray[np.float64]:
        """Values for ``slots`` (>= 0) whose last events are ``events``; misses via ``compute(events)``."""
        if slots.size == 0:
            return np.zeros(0, dtype=np.float64)
        self.warm(slots, events, version, compute)
        return self._val[slots]

    def warm(
        self,
        slots: npt.NDArray[np.int64],
        events: npt.NDArray[np.int64],
        version: Hashable,
        compute: Callable[[npt.NDArray[np.int64]], npt.NDArray[np.float64]],
    ) -> int:
        """Compute the stale entries of ``slots`` now (as :meth:`get` would); returns how many."""
        if slots.size == 0:
            return 0
        self._prepare(slots, version)
        miss = np.flatnonzero(self._ev[slots] != events)
        if miss.size:
            ms = slots[miss]
            self._val[ms] = _chunked(compute, events[miss])
            self._ev[ms] = events[miss]
        return int(miss.size)

    def remap(
        self,
        version: Hashable,
        live_from: int,
        fn: Callable[[npt.NDArray[np.float64], npt.NDArray[np.int64]], npt.NDArray[np.float64]],
    ) -> int:
        """Replace every entry computed under ``version`` whose event id is ``>= live_from`` by
        ``fn(values, events)`` (e.g. a change of scale of a derived value) and drop the other entries;
        nothing to keep under another version. Returns the entries kept."""
        if version != self._version:
            return 0
        keep = np.flatnonzero(self._ev >= max(live_from, 0))
        self._val[keep] = fn(self._val[keep], self._ev[keep])
        drop = self._ev >= 0
        drop[keep] = False
        self._ev[drop] = -1
        return int(keep.size)

    def _prepare(self, slots: npt.NDArray[np.int64], version: Hashable) -> None:
        if version != self._version:
            self._ev[:] = -1
            self._version = version
        need = int(slots.max()) + 1
        if need > self._ev.shape[0]:
            size = grown_size(self._ev.shape[0], need)
            ev = np.full(size, -1, dtype=np.int64)
            ev[: self._ev.shape[0]] = self._ev
            val = np.zeros(size, dtype=np.float64)
            val[: self._val.shape[0]] = self._val
            self._ev, self._val = ev, val

    @property
    def nbytes(self) -> int:
        return int(self._val.nbytes + self._ev.nbytes)


_CHUNK = 16_384  # rows per compute call: bounds the temporaries (a model's feature matrix) per call


def _chunked(
    compute: Callable[[npt.NDArray[np.int64]], npt.NDArray[np.float64]], events: npt.NDArray[np.int64]
) -> npt.NDArray[np.float64]:
    if events.shape[0] <= _CHUNK:
        return compute(events)
    return np.concatenate([compute(events[i : i + _CHUNK]) for i in range(0, events.shape[0], _CHUNK)])
