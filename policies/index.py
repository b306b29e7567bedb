"""Block / prefix index: compact per-block state for millions of KV blocks (pure, no I/O).

Every tracked block gets a dense slot; its state lives in parallel numpy arrays (no Python object per
block). External ids are 64-bit hashes: Mooncake trace ids, or vLLM's uint64 chained block hashes (values
>= 2**63 are folded to int64 by two's complement, so both spellings of one hash hit the same slot).

Per block: hash, parent slot, depth (0 = root block), resident-tier bitmask (a block may sit in several
tiers), last access and first seen time (ms), access count, last reuse gap and its EWMA (ms), bytes,
number of tracked children and, per tier, of children resident in that tier (leaf-first eviction: a block
is evictable from a tier only when no child is resident there). About 190 bytes per tracked block
including the hash->slot map, so 10 M blocks fit in ~2 GB; ``max_blocks`` bounds it by reclaiming the
stalest blocks that are resident nowhere and have no tracked children.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvtier.policies.slotmap import SlotMap
from kvtier.policies.tiers import TIER_ORDER, Tier, normalize_tier

_U64 = 1 << 64
_I64_MAX = (1 << 63) - 1
_N_TIERS = len(TIER_ORDER)
_EWMA_ALPHA = 0.3
_CHANGE_LOG = 65_536  # changed slots remembered for incremental readers (sizes; touches)
_NBYTES_MAX = 2**31 - 1  # per-block KV bytes are int32 (a 256-token chunk of a 405B model is ~130 MB)


class SlotLog:
    """The last changed slots (bounded), for readers that refresh only what changed: ``version`` counts
    every change; :meth:`since` gives the slots changed after ``version`` was ``v`` (repeats possible),
    or None once the log no longer reaches back that far (then refresh every row).

    A numpy ring, not a deque of ints: 65k scattered int objects cost the cyclic GC's full collections
    a cache miss each (twice per collection), inside whichever tick triggered it. Single adds are
    buffered in a short list and written to the ring in batches."""

    _BATCH = 4096

    def __init__(self, size: int = _CHANGE_LOG) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.version = 0
        self._size = size
        self._ring = np.zeros(size, np.int64)
        self._held = 0  # entries in the ring (<= size)
        self._pend: list[int] = []  # added, not yet in the ring (their versions end at self.version)
        self._batch = min(self._BATCH, size)  # a flush never wraps the ring onto itself

    def add(self, s: int) -> None:
        self.version += 1
        self._pend.append(s)
        if len(self._pend) >= self._batch:
            self._flush()

    def _write(self, slots: npt.NDArray[np.int64], first_version: int) -> None:
        k = slots.shape[0]
        pos = (first_version + np.arange(k, dtype=np.int64)) % self._size
        self._ring[pos] = slots
        self._held = min(self._size, self._held + k)

    def _flush(self) -> None:
        if self._pend:
            k = len(self._pend)
            self._write(np.array(self._pend, np.int64), self.version - k)
            self._pend.clear()

    def extend(self, slots: npt.NDArray[np.intp]) -> None:
        self._flush()
        if slots.size > self._size:
            self.version += self._size + 1  # more than the log holds: readers refresh everything
            self._held = 0
            return
        self._write(np.asarray(slots, np.int64).reshape(-1), self.version)
        self.version += int(slots.size)

    def since(self, version: int) -> npt.NDArray[np.intp] | None:
        k = self.version - version
        self._flush()
        if k < 0 or k > self._held:
            return None
        pos = (version + np.arange(k, dtype=np.int64)) % self._size
        return self._ring[pos].astype(np.intp)


class IndexFullError(MemoryError):
    """``max_blocks`` reached and nothing can be reclaimed (every block is resident or has children)."""


def to_key(h: int) -> int:
    """Fold a 64-bit hash (signed or unsigned) to the int64 value used as key."""
    h = int(h)
    if h > _I64_MAX:
        if h >= _U64:
            raise ValueError(f"block hash {h} does not fit in 64 bits")
        return h - _U64
    if h < -(1 << 63):
        raise ValueError(f"block hash {h} does not fit in 64 bits")
    return h


_RANK_CACHE: dict[object, int] = {}


def _tier_rank(tier: Tier | str | int) -> int:
    r = _RANK_CACHE.get(tier)
    if r is not None:
        return r
    if isinstance(tier, int) and not isinstance(tier, bool):
        if not 0 <= tier < _N_TIERS:
            raise ValueError(f"tier rank must be in [0, {_N_TIERS}), got {tier}")
        return tier
    r = normalize_tier(str(tier)).rank
    if len(_RANK_CACHE) < 256:
        _RANK_CACHE[tier] = r
    return r


@dataclass(frozen=True, slots=True)
class BlockState:
    """A snapshot of one block's state (times in ms, sizes in bytes)."""

    hash: int  # int64-folded key
    parent: int | None  # parent hash, None for a root or an untracked parent
    depth: int
    tiers: tuple[Tier, ...]  # tiers holding it now, fastest first
    last_access_ms: float
    first_seen_ms: float
    frequency: int  # accesses (stores count as one)
    last_gap_ms: float  # NaN until the second access
    gap_ewma_ms: float  # NaN until the second access
    nbytes: int
    children: int  # tracked children
    resident_children: dict[Tier, int]

    @property
    def resident(self) -> bool:
        return bool(self.tiers)


class BlockIndex:
    """Tracks blocks by hash: prefix tree links, residency per tier, recency/frequency/gap statistics.

    The per-slot arrays are public for vectorised reads; write them through the methods only (the change
    logs and ``last_access_max`` that incremental readers rely on are kept there)."""

    def __init__(self, initial_capacity: int = 1 << 14, *, max_blocks: int | None = None) -> None:
        if max_blocks is not None and max_blocks <= 0:
            raise ValueError(f"max_blocks must be > 0, got {max_blocks}")
        self.max_blocks = max_blocks
        # writers (the ingest path's bulk apply, on the event loop) and readers on another thread (the
        # reconcile tick, in a worker thread) take this; a writer that finds it held defers, never waits
        self.lock = threading.RLock()
        cap = max(16, initial_capacity if max_blocks is None else min(initial_capacity, max_blocks))
        # int64 key -> slot (numpy open addressing: ~16-32 B per block), sized like the slot arrays so a
        # growing index does not rehash it from 1,024 entries up
        self._slot = SlotMap(cap)
        self._free: list[int] = []
        self._n = 0  # high-water mark of used slots
        self.reclaimed = 0  # slots reclaimed under max_blocks pressure
        # block sizes change rarely (stores with a size, slot drops): the last changed rows, so a reader
        # of ``nbytes`` can refresh only those (:meth:`nbytes_changed_since`); write sizes through here
        self._nbytes_log = SlotLog()
        # rows whose access stats (freq, gap EWMA) changed: touches and slot drops (:meth:`touched_since`)
        self._touch_log = SlotLog()
        self.last_access_max = -np.inf  # latest access time ever written (ms): readers skip age clamps
        self._alloc(cap)

    # ---- storage -------------------------------------------------------------------------------------
    def _alloc(self, cap: int) -> None:
        self.hash = np.zeros(cap, dtype=np.int64)
        self.parent = np.full(cap, -1, dtype=np.int32)
        self.depth = np.zeros(cap, dtype=np.int32)
        self.tiers = np.zeros(cap, dtype=np.uint8)  # bit r = resident in TIER_ORDER[r]
        self.last_access = np.zeros(cap, dtype=np.float64)
        self.first_seen = np.zeros(cap, dtype=np.float64)
        self.freq = np.zeros(cap, dtype=np.uint32)
        self.last_gap = np.full(cap, np.nan, dtype=np.float32)
        self.gap_ewma = np.full(cap, np.nan, dtype=np.float32)
        self.nbytes = np.zeros(cap, dtype=np.int32)  # KV bytes (0 = unknown); < 2 GiB per block
        self.n_children = np.zeros(cap, dtype=np.int32)
        self.res_children = np.zeros((cap, _N_TIERS), dtype=np.int32)
        self.used = np.zeros(cap, dtype=np.bool_)

    _FIELDS = (
        "hash", "parent", "depth", "tiers", "last_access", "first_seen", "freq", "last_gap", "gap_ewma",
        "nbytes", "n_children", "res_children", "used",
    )  # fmt: skip

    def _grow(self) -> None:
        old = self.hash.shape[0]
        new = old * 2 if self.max_blocks is None else min(old * 2, self.max_blocks)
        for f in self._FIELDS:
            a = getattr(self, f)
            b = np.empty((new, *a.shape[1:]), dtype=a.dtype)
            b[:old] = a
            if f == "parent":
                b[old:] = -1
            elif f in ("last_gap", "gap_ewma"):
                b[old:] = np.nan
            else:
                b[old:] = 0
            setattr(self, f, b)

    @property
    def capacity(self) -> int:
        """Allocated slots."""
        return int(self.hash.shape[0])

    @property
    def n_rows(self) -> int:
        """Rows handed out so far (slots ``[0, n_rows)``; free-listed ones among them are unused)."""
        return self._n

    @property
    def epoch(self) -> int:
        """Changes whenever a slot is dropped (and may be reused for another hash): a cached hash -> slot
        mapping taken under the same epoch is still valid."""
        return self.reclaimed

    def set_nbytes(self, s: int, nbytes: int) -> None:
        """Set slot ``s``'s size (bytes; 0 = unknown) and log the change."""
        self.nbytes[s] = nbytes
        self._nbytes_log.add(s)

    def note_nbytes_changed(self, slots: npt.NDArray[np.intp]) -> None:
        """Log a bulk write of ``nbytes[slots]`` (made by the caller)."""
        self._nbytes_log.extend(slots)

    @property
    def nbytes_version(self) -> int:
        return self._nbytes_log.version

    def nbytes_changed_since(self, version: int) -> npt.NDArray[np.intp] | None:
        """Slots whose size changed after ``nbytes_version`` was ``version`` (repeats possible), or None
        when the log no longer reaches back that far (refresh every row)."""
        return self._nbytes_log.since(version)

    @property
    def touch_version(self) -> int:
        return self._touch_log.version

    def touched_since(self, version: int) -> npt.NDArray[np.intp] | None:
        """Slots whose ``freq`` or ``gap_ewma`` may have changed (touched, or dropped) after
        ``touch_version`` was ``version`` (repeats possible), or None when the log no longer reaches back
        that far (compare every row)."""
        return self._touch_log.since(version)

    def nbytes_per_block(self) -> float:
        """Approximate memory per tracked block (arrays per allocated slot + the hash map), bytes."""
        arrays = sum(getattr(self, f).nbytes for f in self._FIELDS)
        per_slot = arrays / self.capacity
        return per_slot + self._slot.nbytes / max(1, len(self._slot))

    def __len__(self) -> int:
        return len(self._slot)

    def __contains__(self, h: int) -> bool:
        return to_key(h) in self._slot

    def slot_of(self, h: int) -> int:
        """Dense slot of ``h`` or -1 if untracked."""
        return self._slot.get(to_key(h))

    def slots_of(self, hashes: Iterable[int]) -> npt.NDArray[np.int64]:
        """Slots of many hashes (-1 for untracked)."""
        get = self._slot.get
        return np.fromiter((get(to_key(h), -1) for h in hashes), dtype=np.int64)

    def slots_of_keys(self, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """Slots of int64 keys (already folded, e.g. taken from :attr:`hash`), -1 for untracked."""
        return self._slot.get_many(keys)

    def get_or_allocate_slots(
        self, keys: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.bool_]]:
        """Slots of the distinct int64 ``keys``, allocating one for each untracked key (free list first,
        then fresh rows, growing the arrays). Returns (slots, which are new); the new slots' fields are the
        caller's to initialise. One vectorised lookup + insert (a ``setdefault`` with a candidate slot
        each); unused candidates go back to the free list."""
        m = keys.size
        from_free = min(m, len(self._free))
        fresh = m - from_free
        while self._n + fresh > self.capacity:
            self._grow()
        free = self._free
        cand_l = free[len(free) - from_free :]
        del free[len(free) - from_free :]
        cand = np.empty(m, dtype=np.int64)
        cand[:from_free] = cand_l
        cand[from_free:] = np.arange(self._n, self._n + fresh)
        self._n += fresh
        # setdefault per (distinct) key: the existing slot, else the candidate (one probing pass)
        got = self._slot.get_or_put(keys, cand)
        is_new = got == cand
        if not is_new.all():
            free.extend(cand[~is_new].tolist())
        return got, is_new

    def _new_slot(self, key: int) -> int:
        if self._free:
            s = self._free.pop()
        else:
            if self._n >= self.capacity:
                if self.max_blocks is not None and self.capacity >= self.max_blocks:
                    self._reclaim()
                    return self._new_slot(key)
                self._grow()
            s = self._n
            self._n += 1
        self._slot.put(key, s)
        self.hash[s] = key  # the other fields hold their defaults: fresh from _alloc/_grow or reset on drop
        self.used[s] = True
        return s

    def _reclaim(self) -> None:
        """Free ~1/16 of the slots: the stalest ones resident nowhere and without tracked children."""
        n = self._n
        cand = np.flatnonzero(self.used[:n] & (self.tiers[:n] == 0) & (self.n_children[:n] == 0))
        if cand.size == 0:
            raise IndexFullError(
                f"block index full ({self.max_blocks} blocks, all resident or with children)"
            )
        k = max(1, min(cand.size, self.capacity // 16))
        if k < cand.size:
            cand = cand[np.argpartition(self.last_access[cand], k - 1)[:k]]
        self._drop_slots(cand)
        self.reclaimed += int(cand.size)

    def room(self) -> int | None:
        """Blocks that can still be tracked without reclaiming (None: no ``max_blocks`` bound)."""
        if self.max_blocks is None:
            return None
        return self.max_blocks - self._n + len(self._free)

    def make_room(self, k: int) -> None:
        """Reclaim (:meth:`_reclaim`, in bulk) until ``k`` more blocks fit under ``max_blocks``; raises
        :class:`IndexFullError` when nothing more can be reclaimed (all resident or with children)."""
        room = self.room()
        while room is not None and room < k:
            self._reclaim()
            room = self.room()

    def _drop_slots(self, slots: npt.NDArray[np.intp]) -> None:
        """Forget distinct childless slots (reclaimed): unlink, reset their fields, free them (the map
        deletions stay scalar)."""
        if slots.size == 0:
            return
        par = self.parent[slots].astype(np.int64)
        par = par[par >= 0]
        if par.size:
            np.subtract.at(self.n_children, par, 1)
        pop = self._slot.pop
        for key in self.hash[slots].tolist():
            pop(key)
        self.used[slots] = False
        self.parent[slots] = -1
        self.depth[slots] = 0
        self.tiers[slots] = 0
        self.freq[slots] = 0
        self.last_gap[slots] = np.nan
        self.gap_ewma[slots] = np.nan
        self._touch_log.extend(slots)
        sized = slots[self.nbytes[slots] != 0]
        if sized.size:
            self.nbytes[sized] = 0
            self.note_nbytes_changed(sized)
        self.n_children[slots] = 0
        self.res_children[slots] = 0
        self._free.extend(slots.tolist())

    # ---- updates --------------------------------------------------------------------------------------
    def _ensure(self, key: int, parent_key: int | None, t: float) -> int:
        s = self._slot.get(key)
        if s >= 0:
            if parent_key is not None and self.parent[s] < 0:
                self._link(s, parent_key)
            return s
        s = self._new_slot(key)
        self.first_seen[s] = t
        self.last_access[s] = t
        if t > self.last_access_max:
            self.last_access_max = t
        if parent_key is not None:
            self._link(s, parent_key)
        return s

    def _link(self, s: int, parent_key: int) -> None:
        p = self._slot.get(parent_key)
        if p < 0 or p == s:
            return
        self.parent[s] = p
        self.depth[s] = self.depth[p] + 1
        self.n_children[p] += 1
        m = int(self.tiers[s])
        if m:
            for r in range(_N_TIERS):
                if m >> r & 1:
                    self.res_children[p, r] += 1

    def _set_tier(self, s: int, r: int) -> bool:
        bit = 1 << r
        if self.tiers[s] & bit:
            return False
        self.tiers[s] |= bit
        p = int(self.parent[s])
        if p >= 0:
            self.res_children[p, r] += 1
        return True

    def _clear_tier(self, s: int, r: int) -> bool:
        bit = 1 << r
        if not self.tiers[s] & bit:
            return False
        self.tiers[s] &= ~np.uint8(bit)
        p = int(self.parent[s])
        if p >= 0:
            self.res_children[p, r] -= 1
        return True

    def _touch_slot(self, s: int, t: float) -> None:
        if self.freq[s] > 0:
            gap = t - self.last_access[s]
            self.last_gap[s] = gap
            e = self.gap_ewma[s]
            self.gap_ewma[s] = gap if np.isnan(e) else (1 - _EWMA_ALPHA) * e + _EWMA_ALPHA * gap
        self.freq[s] += 1
        self.last_access[s] = t
        if t > self.last_access_max:
            self.last_access_max = t
        self._touch_log.add(s)

    def store(
        self, h: int, parent_hash: int | None, tier: Tier | str | int, nbytes: int = 0, t: float = 0.0
    ) -> bool:
        """Block ``h`` (child of ``parent_hash``) is now resident in ``tier``; returns True if newly so.

        A store of an unseen block counts as its first access at ``t`` (ms)."""
        pkey = None if parent_hash is None else to_key(parent_hash)
        return self._store(to_key(h), pkey, _tier_rank(tier), nbytes, t)

    def _store(self, key: int, pkey: int | None, r: int, nbytes: int, t: float) -> bool:
        if not -_NBYTES_MAX <= nbytes <= _NBYTES_MAX:  # checked before any state changes
            raise ValueError(f"block size {nbytes} bytes out of range (at most {_NBYTES_MAX} per block)")
        s = self._slot.get(key)
        if s < 0:
            s = self._new_slot(key)
            self.first_seen[s] = t
            self.last_access[s] = t
            if t > self.last_access_max:
                self.last_access_max = t
            self.freq[s] = 1  # the store is its first access
            self._touch_log.add(s)
            if pkey is not None:
                self._link(s, pkey)
        elif pkey is not None and self.parent[s] < 0:
            self._link(s, pkey)
        if nbytes and self.nbytes[s] != nbytes:
            self.set_nbytes(s, nbytes)
        return self._set_tier(s, r)

    def store_chain(
        self,
        hashes: Sequence[int],
        parent_hash: int | None,
        tier: Tier | str | int,
        nbytes: int = 0,
        t: float = 0.0,
    ) -> int:
        """Store a chain root-first (vLLM ``BlockStored``: ``parent_hash`` precedes ``hashes[0]``).

        Returns how many blocks became newly resident in ``tier``."""
        r = _tier_rank(tier)
        n = 0
        parent = None if parent_hash is None else to_key(parent_hash)
        for h in hashes:
            key = to_key(h)
            n += self._store(key, parent, r, nbytes, t)
            parent = key
        return n

    def remove(self, h: int, tier: Tier | str | int | None = None) -> bool:
        """Block ``h`` left ``tier`` (every tier if None). Its statistics are kept. True if it was there."""
        s = self._slot.get(to_key(h))
        if s < 0:
            return False
        if tier is None:
            return any([self._clear_tier(s, r) for r in range(_N_TIERS)])
        return self._clear_tier(s, _tier_rank(tier))

    def clear(self, tier: Tier | str | int | None = None) -> int:
        """Everything left ``tier`` (all tiers if None), e.g. vLLM ``AllBlocksCleared``.

        Returns the number of blocks affected."""
        n = self._n
        ranks = range(_N_TIERS) if tier is None else [_tier_rank(tier)]
        mask = np.uint8(sum(1 << r for r in ranks))
        affected = int(np.count_nonzero(self.tiers[:n] & mask))
        self.tiers[:n] &= ~mask
        for r in ranks:
            self.res_children[:n, r] = 0
        return affected

    def touch(self, h: int, t: float) -> bool:
        """Record an access (lookup hit or request use) of ``h`` at ``t`` ms. False if untracked."""
        s = self._slot.get(to_key(h))
        if s < 0:
            return False
        self._touch_slot(s, t)
        return True

    def access_chain(self, hashes: Sequence[int], t: float) -> npt.NDArray[np.int64]:
        """A request used ``hashes`` (root first) at ``t``: track unseen ones (linked in order), count an
        access for each. Returns their slots."""
        out = np.empty(len(hashes), dtype=np.int64)
        parent: int | None = None
        for i, h in enumerate(hashes):
            key = to_key(h)
            s = self._ensure(key, parent, t)
            self._touch_slot(s, t)
            out[i] = s
            parent = key
        return out

    # ---- queries --------------------------------------------------------------------------------------
    def get(self, h: int) -> BlockState | None:
        """State of ``h`` or None if untracked."""
        s = self._slot.get(to_key(h))
        if s < 0:
            return None
        p = int(self.parent[s])
        m = int(self.tiers[s])
        return BlockState(
            hash=int(self.hash[s]),
            parent=int(self.hash[p]) if p >= 0 else None,
            depth=int(self.depth[s]),
            tiers=tuple(t for r, t in enumerate(TIER_ORDER) if m >> r & 1),
            last_access_ms=float(self.last_access[s]),
            first_seen_ms=float(self.first_seen[s]),
            frequency=int(self.freq[s]),
            last_gap_ms=float(self.last_gap[s]),
            gap_ewma_ms=float(self.gap_ewma[s]),
            nbytes=int(self.nbytes[s]),
            children=int(self.n_children[s]),
            resident_children={t: int(self.res_children[s, r]) for r, t in enumerate(TIER_ORDER)},
        )

    def count_by_tier(self) -> dict[Tier, int]:
        """Resident blocks per tier."""
        m = self.tiers[: self._n]
        return {t: int(np.count_nonzero(m & (1 << r))) for r, t in enumerate(TIER_ORDER)}

    def bytes_by_tier(self) -> dict[Tier, int]:
        """Resident bytes per tier."""
        m = self.tiers[: self._n]
        nb = self.nbytes[: self._n]
        return {t: int(nb[(m & (1 << r)) != 0].sum()) for r, t in enumerate(TIER_ORDER)}

    def is_evictable(self, h: int, tier: Tier | str | int) -> bool:
        """Resident in ``tier`` with no child resident there (a leaf of that tier's prefix tree)."""
        s = self._slot.get(to_key(h))
        if s < 0:
            return False
        r = _tier_rank(tier)
        return bool(self.tiers[s] >> r & 1) and self.res_children[s, r] == 0

    def leaves(self, tier: Tier | str | int) -> npt.NDArray[np.int64]:
        """Slots of the evictable blocks of ``tier``."""
        r = _tier_rank(tier)
        n = self._n
        return np.flatnonzero(((self.tiers[:n] >> r) & 1).astype(bool) & (self.res_children[:n, r] == 0))

    def pick_victims(
        self, tier: Tier | str | int, n: int, score: npt.NDArray[np.float64] | None = None
    ) -> list[int]:
        """Up to ``n`` hashes to evict from ``tier`` leaf-first, lowest ``score`` first (default: least
        recently accessed). ``score`` is indexed by slot. Never returns a block whose children stay
        resident in ``tier``; does not modify the index (call :meth:`remove` for the ones you evict)."""
        r = _tier_rank(tier)
        key = self.last_access if score is None else score
        lim = self._n
        pending = self.res_children[:lim, r].copy()
        taken = np.zeros(lim, dtype=np.bool_)
        resident = ((self.tiers[:lim] >> r) & 1).astype(bool)
        out: list[int] = []
        while len(out) < n:
            cand = np.flatnonzero(resident & ~taken & (pending == 0))
            if cand.size == 0:
                break
            k = min(n - len(out), cand.size)
            if k < cand.size:
                cand = cand[np.argpartition(key[cand], k - 1)[:k]]
            cand = cand[np.argsort(key[cand], kind="stable")]
            taken[cand] = True
            par = self.parent[cand]
            par = par[par >= 0]
            np.subtract.at(pending, par, 1)
            out.extend(int(x) for x in self.hash[cand])
        return out

    def hash_of(self, slot: int) -> int:
        """int64 key stored at ``slot``."""
        return int(self.hash[slot])
