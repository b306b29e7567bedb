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

Times passed to the index are milliseconds (publisher batch ``ts`` * 1000). Residency (the reference counts
behind :meth:`KvIngestor.blocks_tracked`) is updated immediately; index updates are queued and applied in bulk
(:mod:`kvtier.policies.index_bulk`) every ``flush_every`` operations and on :meth:`KvIngestor.flush` --
call it (or use :meth:`KvIngestor.flushed_index`) before querying the index.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from itertools import repeat

from kvtier.collectors.vllm_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    DecodedBatch,
    tier_of,
)
from kvtier.policies.index import BlockIndex
from kvtier.policies.index_bulk import REMOVE, STORE, TOUCH, TOUCH_CHAIN, OpQueue, apply_ops
from kvtier.policies.tiers import TIER_ORDER, Tier

EVENT_TYPES = ("BlockStored", "BlockRemoved", "AllBlocksCleared")
_RANK = {t: i for i, t in enumerate(TIER_ORDER)}  # index accepts int ranks without name lookups


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


class KvIngestor:
    """Applies decoded KV-event batches to a :class:`~kvtier.policies.index.BlockIndex`."""

    def __init__(self, index: BlockIndex | None = None, *, flush_every: int = 16384) -> None:
        self.index = index if index is not None else BlockIndex()
        self.flush_every = flush_every
        self._q = OpQueue()
        self._held: dict[str, dict[Tier, set[int]]] = {}  # source -> tier -> u64 hashes
        self._rc: dict[Tier, dict[int, int]] = {t: {} for t in TIER_ORDER}
        self.counts: dict[str, SourceCounts] = defaultdict(SourceCounts)  # engine label -> counters

    # ---- queries ----------------------------------------------------------------------------------------
    def flush(self) -> None:
        """Apply the queued index operations now."""
        apply_ops(self.index, self._q)

    def flushed_index(self) -> BlockIndex:
        """The index with every received event applied."""
        self.flush()
        return self.index

    def blocks_tracked(self) -> dict[str, int]:
        """Blocks believed resident per tier (lowercase tier names), from the reference counts."""
        return {t.value: len(self._rc[t]) for t in TIER_ORDER}

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

    def apply_events(
        self,
        engine: str,
        events: list[BlockStored | BlockRemoved | AllBlocksCleared],
        t_ms: float,
        source: str | None = None,
    ) -> None:
        held = self._src(source or engine)
        c = self.counts[engine]
        q = self._q
        qa = q.ops.append
        ctx: dict[str | None, tuple[Tier, int, set[int], dict[int, int]]] = {}
        n_stored = n_removed = n_cleared = 0
        for e in events:
            if type(e) is BlockRemoved:
                n_removed += 1
                x = ctx.get(e.medium)
                if x is None:
                    tier = tier_of(e.medium)
                    x = ctx[e.medium] = (tier, _RANK[tier], held[tier], self._rc[tier])
                tier, rank, mine, rc = x
                for k in e.block_hashes:
                    if k in mine:
                        mine.discard(k)
                        c.blocks_removed += 1
                        n = rc.get(k, 0)
                        if n <= 1:
                            rc.pop(k, None)
                            qa((REMOVE, k, None, rank, t_ms))
                        else:
                            rc[k] = n - 1
                    else:
                        c.removed_unknown += 1
            elif type(e) is BlockStored:
                n_stored += 1
                x = ctx.get(e.medium)
                if x is None:
                    tier = tier_of(e.medium)
                    x = ctx[e.medium] = (tier, _RANK[tier], held[tier], self._rc[tier])
                tier, rank, mine, rc = x
                hs = e.block_hashes
                nh = len(hs)
                pkey = e.parent_block_hash
                if pkey is not None:  # the request used the whole parent chain
                    qa((TOUCH_CHAIN, pkey, None, rank, t_ms))
                    c.accesses_inferred += 1
                if mine.isdisjoint(hs) and rc.keys().isdisjoint(hs) and len(set(hs)) == nh:
                    # common case: all new blocks, held by no other source -> bulk append
                    mine.update(hs)
                    for k in hs:
                        rc[k] = 1
                    c.blocks_stored += nh
                    parents = [pkey, *hs[:-1]]
                    rt = repeat(rank, nh)
                    stores = zip(repeat(STORE, nh), hs, parents, rt, repeat(t_ms, nh), strict=False)
                    q.ops.extend(stores)
                    continue
                for k in hs:
                    if k in mine:  # re-announcement = a hit report
                        c.blocks_reannounced += 1
                        c.accesses_inferred += 1
                        qa((TOUCH, k, None, rank, t_ms))
                    else:
                        mine.add(k)
                        n = rc.get(k, 0)
                        rc[k] = n + 1
                        c.blocks_stored += 1
                        # STORE, or an access if another source holds it already
                        qa((STORE, k, pkey, rank, t_ms) if n == 0 else (TOUCH, k, None, rank, t_ms))
                    pkey = k
            elif type(e) is AllBlocksCleared:
                n_cleared += 1
                c.blocks_cleared += self._clear(held, tier_of(e.medium))
        ev = c.events
        ev["BlockStored"] += n_stored
        ev["BlockRemoved"] += n_removed
        ev["AllBlocksCleared"] += n_cleared
        if len(q) >= self.flush_every:
            self.flush()

    def clear_source(self, engine: str, source: str | None = None) -> int:
        """The source restarted (its caches are empty): drop everything it held, every tier."""
        held = self._src(source or engine)
        n = sum(self._clear(held, t) for t in TIER_ORDER)
        self.counts[engine].blocks_cleared += n
        return n

    # ---- internals --------------------------------------------------------------------------------------
    def _unref(self, rc: dict[int, int], k: int, tier: Tier) -> None:
        n = rc.get(k, 0)
        if n <= 1:
            rc.pop(k, None)
            self._q.ops.append((REMOVE, k, None, _RANK[tier], 0.0))
        else:
            rc[k] = n - 1

    def _clear(self, held: dict[Tier, set[int]], tier: Tier) -> int:
        mine = held[tier]
        n = len(mine)
        rc = self._rc[tier]
        for k in mine:
            self._unref(rc, k, tier)
        mine.clear()
        return n
