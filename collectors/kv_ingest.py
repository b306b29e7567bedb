"""KV events -> the block index of ``policies/`` (pure, no I/O; the subscriber feeds it decoded batches).

Per source (one engine / DP rank) it keeps which block hashes that source holds in which tier, and a
reference count per (tier, hash) across sources, so a block held by two engines stays resident until both
removed it (vLLM's docs ask consumers to reference-count repeated announcements).

* ``BlockStored`` of a hash the source did not hold: the block becomes resident (``index.store``).
* ``BlockStored`` of a hash the source already holds: a re-announcement, i.e. a prefix-cache hit reported by a
  request with ``kv_cache_report_mode: full`` -> an access (``index.touch``).
* ``BlockStored`` with a ``parent_block_hash``: the request that computed these blocks used the whole parent
  chain -> every tracked ancestor is touched once (accesses inferred from parent chains).
* ``BlockRemoved``: the source dropped the block; when no source holds it any more, ``index.remove``.
* ``AllBlocksCleared`` (and :meth:`KvIngestor.clear_source`, used when an engine restarts): everything that
  source held in that tier (default GPU) is removed.
* An event whose ``medium`` is not a known tier spelling is skipped and counted (``unknown_medium``), never
  mapped to a guessed tier (the decoder already drops them; this guards direct callers).

Bounds (a flood of forged or runaway events must not grow memory without limit): an event with more than
``max_hashes_per_event`` hashes is skipped and counted (``oversized_events``); blocks believed resident, all
tiers together, never exceed the index's own bound (``index.max_blocks``, ``KVTIER_INDEX_MAX_BLOCKS``) -- a
store of blocks that would pass it is skipped and counted (``residency_skipped``) before it reaches the index,
so the full-index case costs what a normal store costs.

Times passed to the index are milliseconds (publisher batch ``ts`` * 1000). Residency (the reference counts
behind :meth:`KvIngestor.blocks_tracked`) is updated immediately; index updates are queued and applied in bulk
(:mod:`kvtier.policies.index_bulk`) every ``flush_every`` operations and on :meth:`KvIngestor.flush` --
call it (or use :meth:`KvIngestor.flushed_index`) before querying the index.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Protocol

from kvtier.collectors.vllm_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    UnknownMediumError,
    tier_of,
)
from kvtier.policies.index import BlockIndex
from kvtier.policies.index_bulk import REMOVE, STORE, TOUCH, TOUCH_CHAIN, OpQueue, apply_ops
from kvtier.policies.tiers import TIER_ORDER, Tier

log = logging.getLogger(__name__)

EVENT_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
_RANK = {t: i for i, t in enumerate(TIER_ORDER)}  # index accepts int ranks without name lookups
_NONE = object()  # no run of removals yet (a medium can be None)
_MEDIA: dict[str | None, tuple[Tier, int]] = {}  # event medium -> (tier, rank), memoised


def _tier_rank(medium: str | None) -> tuple[Tier, int] | None:
    """(tier, rank) of a known medium spelling; None for an unknown one."""
    x = _MEDIA.get(medium)
    if x is None:
        try:
            tier = tier_of(medium)
        except UnknownMediumError:
            return None
        x = (tier, _RANK[tier])
        if len(_MEDIA) < 1024:
            _MEDIA[medium] = x
    return x


@dataclass(slots=True)
class SourceCounts:
    """Cumulative per-engine counters (events = event objects; blocks = block hashes in them)."""

    events: dict[str, int] = field(default_factory=lambda: dict.fromkeys(EVENT_TYPES, 0))
    blocks_stored: int = 0  # newly resident block hashes
    blocks_removed: int = 0  # hashes removed that the source held
    blocks_reannounced: int = 0  # BlockStored for a hash already held (hit reports)
    removed_unknown: int = 0  # BlockRemoved for a hash the source did not hold (store missed/never seen)
    blocks_cleared: int = 0  # hashes dropped by AllBlocksCleared or a restart
    accesses_inferred: int = 0  # index touches from parent chains and hit reports
    unknown_medium: int = 0  # events skipped because their medium is not a known tier spelling
    oversized_events: int = 0  # events skipped for carrying more than max_hashes_per_event hashes
    residency_skipped: int = 0  # newly stored hashes not tracked: residency was at its bound


class BatchSink(Protocol):
    """Told about every batch after the index took it (the control plane: warm-up tokens, request
    inference for the placement policy, a loop wake-up). Must not raise for a bad event."""

    def on_batch(self, engine: str, batch: DecodedBatch) -> None: ...


class KvIngestor:
    """Applies decoded KV-event batches to a :class:`~kvtier.policies.index.BlockIndex`, then notifies its
    :attr:`sinks`."""

    def __init__(
        self, index: BlockIndex | None = None, *, flush_every: int = 16384, max_hashes_per_event: int = 16384
    ) -> None:
        self.index = index if index is not None else BlockIndex()
        self.flush_every = flush_every
        self.max_hashes_per_event = max_hashes_per_event
        # all tiers together, tied to the index's bound (the one configured bound; unbounded index: no cap)
        mb = self.index.max_blocks
        self.max_resident = int(mb) if mb is not None else 1 << 62
        self._q = OpQueue()
        self._held: dict[str, dict[Tier, set[int]]] = {}  # source -> tier -> u64 hashes
        # reference counts per (tier, hash): held by >= 1 source (set) + holders beyond the first (dict)
        self._res: dict[Tier, set[int]] = {t: set() for t in TIER_ORDER}
        self._extra: dict[Tier, dict[int, int]] = {t: {} for t in TIER_ORDER}
        self.counts: dict[str, SourceCounts] = defaultdict(SourceCounts)  # engine label -> counters
        self.index_skipped = 0  # queued index operations skipped because the index was full
        self.flush_deferred = 0  # flushes put off because a reader (the tick) held the index
        self.sinks: list[BatchSink] = []  # notified of each batch after it was applied

    # ---- queries ----------------------------------------------------------------------------------------
    def flush(self, *, wait: bool = True) -> bool:
        """Apply the queued index operations now. Block stores that do not fit a full index (``max_blocks``
        reached, nothing reclaimable) are skipped, counted in :attr:`index_skipped` and logged; residency
        (:meth:`blocks_tracked`) is kept apart from the index and stays exact.

        Under the index's lock: the reconcile tick reads the index from a worker thread, and a bulk apply
        under it (slot-map rehash, array growth) made its lookups fail mid-tick. ``wait=False`` (the event
        loop's callers): when a tick holds the index, return False at once and keep the operations queued
        for the next flush (the queue grows by at most one tick's worth of events)."""
        lock = self.index.lock
        if not lock.acquire(blocking=wait):
            self.flush_deferred += 1
            return False
        try:
            self._apply_queued()
        finally:
            lock.release()
        return True

    def _apply_queued(self) -> None:
        skipped = apply_ops(self.index, self._q)
        if skipped:
            if not self.index_skipped:
                log.warning(
                    "block index full (%s blocks, all resident or with children): %d block stores not "
                    "indexed; counted in index_skipped (raise KVTIER_INDEX_MAX_BLOCKS)",
                    self.index.max_blocks,
                    skipped,
                )
            self.index_skipped += skipped

    @property
    def queued_ops(self) -> int:
        """Index operations received and not applied yet."""
        return len(self._q)

    def flushed_index(self) -> BlockIndex:
        """The index with every received event applied."""
        self.flush()
        return self.index

    def blocks_tracked(self) -> dict[str, int]:
        """Blocks believed resident per tier (lowercase tier names), from the reference counts."""
        return {t.value: len(self._res[t]) for t in TIER_ORDER}

    def resident_total(self) -> int:
        """Distinct (tier, block) pairs believed resident (bounded by :attr:`max_resident`)."""
        return sum(len(s) for s in self._res.values())

    def held(self, source: str, tier: Tier = Tier.GPU) -> int:
        return len(self._held.get(source, {}).get(tier, ()))

    # ---- updates ----------------------------------------------------------------------------------------
    def _src(self, source: str) -> dict[Tier, set[int]]:
        d = self._held.get(source)
        if d is None:
            d = self._held[source] = {t: set() for t in TIER_ORDER}
        return d

    def apply(self, engine: str, batch: DecodedBatch, source: str | None = None) -> None:
        """Apply one batch from ``source`` (default: ``engine``; use ``engine/dpN`` for DP ranks)."""
        self.apply_events(engine, batch.events, batch.ts * 1000.0, source)
        for sink in self.sinks:
            sink.on_batch(engine, batch)

    def apply_events(
        self,
        engine: str,
        events: list[BlockStored | BlockRemoved | AllBlocksCleared],
        t_ms: float,
        source: str | None = None,
    ) -> None:
        held = self._src(source or engine)
        c = self.counts[engine]
        n_stored = n_removed = n_cleared = 0
        run: list[int] = []  # hashes of consecutive BlockRemoved events of one medium, applied together
        run_medium: object = _NONE
        run_tr: tuple[Tier, int] | None = None  # (tier, rank) of run_medium; None = unknown spelling
        cap = self.max_hashes_per_event
        for e in events:
            te = type(e)
            if te is not AllBlocksCleared and len(e.block_hashes) > cap:  # type: ignore[union-attr]
                c.oversized_events += 1
                continue
            if te is BlockRemoved:
                m = e.medium
                if m != run_medium:
                    if run:
                        self._remove(held, c, run, run_tr, t_ms)  # type: ignore[arg-type]
                        run = []
                    run_medium = m
                    run_tr = _MEDIA.get(m) or _tier_rank(m)
                if run_tr is None:
                    c.unknown_medium += 1
                    continue
                n_removed += 1
                run += e.block_hashes  # type: ignore[union-attr]
                continue
            if run:
                self._remove(held, c, run, run_tr, t_ms)  # type: ignore[arg-type]
                run = []
            run_medium = _NONE
            tr = _MEDIA.get(e.medium) or _tier_rank(e.medium)
            if tr is None:
                c.unknown_medium += 1
            elif te is BlockStored:
                n_stored += 1
                self._store(held, c, e, tr, t_ms)  # type: ignore[arg-type]
            elif te is AllBlocksCleared:
                n_cleared += 1
                c.blocks_cleared += self._clear(held, tr[0])
        if run:
            self._remove(held, c, run, run_tr, t_ms)  # type: ignore[arg-type]
        ev = c.events
        ev["BlockStored"] += n_stored
        ev["BlockRemoved"] += n_removed
        ev["AllBlocksCleared"] += n_cleared
        if len(self._q) >= self.flush_every:
            self.flush(wait=False)

    def clear_source(self, engine: str, source: str | None = None) -> int:
        """The source restarted (its caches are empty): drop everything it held, every tier."""
        held = self._src(source or engine)
        n = sum(self._clear(held, t) for t in TIER_ORDER)
        self.counts[engine].blocks_cleared += n
        return n

    # ---- internals --------------------------------------------------------------------------------------
    def _store(
        self, held: dict[Tier, set[int]], c: SourceCounts, e: BlockStored, tr: tuple[Tier, int], t_ms: float
    ) -> None:
        tier, rank = tr
        mine, res = held[tier], self._res[tier]
        q = self._q
        hs = e.block_hashes
        pkey = e.parent_block_hash
        if pkey is not None:  # the request used the whole parent chain
            q.add(TOUCH_CHAIN, pkey, None, rank, t_ms)
            c.accesses_inferred += 1
        new = set(hs)
        if self.resident_total() + len(new) > self.max_resident:
            new -= res  # only hashes no source holds yet would grow residency
            if self.resident_total() + len(new) > self.max_resident:
                c.residency_skipped += len(new)
                hs = [k for k in hs if k in res]  # hits on what is tracked still count
                if not hs:
                    return
                new = set(hs)
        if len(new) == len(hs) and res.isdisjoint(new):
            # common case: all new blocks, held by no source (mine is a subset of res) -> one chain
            mine |= new
            res |= new
            c.blocks_stored += len(hs)
            q.store_chain(hs, pkey, rank, t_ms)
            return
        extra = self._extra[tier]
        for k in hs:
            if k in mine:  # re-announcement = a hit report
                c.blocks_reannounced += 1
                c.accesses_inferred += 1
                q.add(TOUCH, k, None, rank, t_ms)
            else:
                mine.add(k)
                c.blocks_stored += 1
                if k in res:  # another source holds it already: an access
                    extra[k] = extra.get(k, 0) + 1
                    q.add(TOUCH, k, None, rank, t_ms)
                else:
                    res.add(k)
                    q.add(STORE, k, pkey, rank, t_ms)
            pkey = k

    def _remove(
        self, held: dict[Tier, set[int]], c: SourceCounts, hs: list[int], tr: tuple[Tier, int], t_ms: float
    ) -> None:
        tier, rank = tr
        mine, res, extra = held[tier], self._res[tier], self._extra[tier]
        if len(hs) > 1:
            gone = set(hs)
            if len(gone) == len(hs) and gone <= mine and (not extra or extra.keys().isdisjoint(gone)):
                # common case: distinct blocks this source held, no other source holds them -> bulk
                mine -= gone
                res -= gone
                c.blocks_removed += len(hs)
                self._q.add_many(REMOVE, hs, rank, t_ms)
                return
        for k in hs:
            if k in mine:
                mine.discard(k)
                c.blocks_removed += 1
                if self._unref(res, extra, k):
                    self._q.add(REMOVE, k, None, rank, t_ms)
            else:
                c.removed_unknown += 1

    @staticmethod
    def _unref(res: set[int], extra: dict[int, int], k: int) -> bool:
        """One holder of ``k`` fewer; True if nobody holds it any more."""
        n = extra.get(k)
        if n is None:
            res.discard(k)
            return True
        if n <= 1:
            del extra[k]
        else:
            extra[k] = n - 1
        return False

    def _clear(self, held: dict[Tier, set[int]], tier: Tier) -> int:
        mine = held[tier]
        n = len(mine)
        if not n:
            return 0
        res, extra, rank = self._res[tier], self._extra[tier], _RANK[tier]
        if not extra or extra.keys().isdisjoint(mine):
            res -= mine
            self._q.add_many(REMOVE, list(mine), rank, 0.0)
        else:
            for k in mine:
                if self._unref(res, extra, k):
                    self._q.add(REMOVE, k, None, rank, 0.0)
        mine.clear()
        return n
