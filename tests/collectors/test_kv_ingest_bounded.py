"""A bounded block index (``max_blocks``, what ``KVTIER_INDEX_MAX_BLOCKS`` sets in the sidecar) under a
steady KV-event stream: the bulk path reclaims the stalest non-resident blocks itself (never the one-by-one
fallback), stays within the bound, keeps every resident block indexed with its tier, and keeps its hash map
consistent; a bound smaller than the resident set skips and counts the stores that do not fit (never
raises), while residency stays exact. Pure (decoded event structs; the ZMQ path is tested elsewhere)."""

from __future__ import annotations

import random

import numpy as np
import pytest

import kvtier.policies.index_bulk as index_bulk
from kvtier.collectors.kv_ingest import KvIngestor
from kvtier.collectors.vllm_events import AllBlocksCleared, BlockRemoved, BlockStored
from kvtier.policies.index import BlockIndex
from kvtier.policies.tiers import Tier


def feed(ing: KvIngestor, n_batches: int, live_max: int, seed: int = 0) -> list[int]:
    """vLLM-shaped batches: a chain of 8 new blocks (continuing the previous prefix half of the time) and
    removals of the oldest live blocks beyond ``live_max``. Returns the hashes still resident."""
    rng = random.Random(seed)
    live: list[int] = []
    parent: int | None = None
    for i in range(n_batches):
        hs = [rng.getrandbits(64) for _ in range(8)]
        evs: list[BlockStored | BlockRemoved | AllBlocksCleared] = [
            BlockStored(block_hashes=hs, parent_block_hash=parent, medium="GPU")
        ]
        live += hs
        parent = hs[-1] if rng.random() < 0.5 else None
        while len(live) > live_max:
            evs.append(BlockRemoved(block_hashes=[live.pop(0)], medium="GPU"))
        ing.apply_events("e", evs, 1000.0 * i)
    ing.flush()
    return live


def test_bounded_index_reclaims_in_bulk_and_keeps_every_resident_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_slow(*a: object) -> int:
        raise AssertionError("the bulk path fell back to one-by-one")

    monkeypatch.setattr(index_bulk, "_slow", no_slow)
    idx = BlockIndex(initial_capacity=1024, max_blocks=20_000)
    ing = KvIngestor(idx, flush_every=4096)
    live = feed(ing, 12_000, live_max=3_000)  # 96k blocks stored through a 20k-block index
    assert idx.reclaimed > 60_000 and ing.index_skipped == 0
    assert len(idx) <= 20_000 and idx.capacity <= 20_000
    assert ing.blocks_tracked()["gpu"] == len(live) == idx.count_by_tier()[Tier.GPU]
    slots = idx.slots_of(live)
    assert (slots >= 0).all() and (idx.tiers[slots] & 1).all()  # every resident block indexed, in gpu
    used = np.flatnonzero(idx.used[: idx.n_rows])
    assert (idx.slots_of_keys(idx.hash[used]) == used).all() and len(idx) == used.size
    assert (idx.n_children[used] >= 0).all()


def test_a_bound_below_the_resident_set_skips_and_counts_stores() -> None:
    idx = BlockIndex(initial_capacity=256, max_blocks=1_000)
    ing = KvIngestor(idx, flush_every=512)
    live = feed(ing, 400, live_max=2_000)  # 3,200 blocks stay resident: far more than fit
    assert len(idx) <= 1_000 and len(live) == 2_000
    # residency is bounded by the same configured bound: stores past it are skipped and counted, before the
    # index (so a full index costs no more than a normal store)
    assert ing.resident_total() == ing.blocks_tracked()["gpu"] <= 1_000
    assert sum(c.residency_skipped for c in ing.counts.values()) > 0
