"""The sidecar's control path over a *bounded* block index (``KVTIER_INDEX_MAX_BLOCKS``): KV-event batches go
through the real ``KvIngestor`` and ``ControlSink`` (index, request inference, placement feed) while the real
reconcile
loop ticks in shadow mode with the learned placement policy, and the index keeps reclaiming rows for new
blocks. Every tick completes without fallbacks or errors, the policy keeps planning, and every decision
names a block the sidecar saw. Pure (decoded batches, injected clock); the ZMQ path is tested elsewhere."""

from __future__ import annotations

import random
from pathlib import Path

from kvtier.collectors.kv_ingest import KvIngestor
from kvtier.collectors.vllm_events import BlockRemoved, BlockStored, DecodedBatch
from kvtier.controller.policy_doc import PolicyDoc
from kvtier.policies.index import BlockIndex
from kvtier.policies.tiers import Tier, TierSpec
from tests.controller import built


def test_loop_ticks_cleanly_while_the_bounded_index_reclaims(tmp_path: Path) -> None:
    rng = random.Random(5)
    now = [1_000.0]
    idx = BlockIndex(initial_capacity=256, max_blocks=3_000)
    ing = KvIngestor(idx, flush_every=256)
    doc = PolicyDoc(
        mode="shadow",
        tiers=[
            TierSpec(tier=Tier.GPU, capacity_blocks=400),
            TierSpec(tier=Tier.CPU, capacity_blocks=800),
        ],
    )
    # the production composition: the root hangs its ControlSink on the ingestor
    plane = built.sidecar(tmp_path, ingestor=ing, mode="shadow", clock=lambda: now[0], doc=doc).plane
    loop = plane.loop
    prefixes = [[rng.getrandbits(63) for _ in range(6)] for _ in range(40)]  # shared prefixes come back
    live: list[int] = []
    seen: set[int] = set()
    decisions = 0
    for step in range(1_500):
        base = rng.choice(prefixes)[: rng.randint(1, 6)]
        tail = [rng.getrandbits(63) for _ in range(rng.randint(1, 4))]
        evs: list[BlockStored | BlockRemoved] = [
            BlockStored(block_hashes=[h for h in base if h not in live], medium="GPU"),
            BlockStored(block_hashes=tail, parent_block_hash=base[-1], medium="GPU"),
        ]
        for h in base + tail:
            if h not in live:
                live.append(h)
        seen.update(base + tail)
        while len(live) > 300:  # the GPU pool evicts its oldest blocks
            evs.append(BlockRemoved(block_hashes=[live.pop(0)], medium="GPU"))
        evs = [e for e in evs if e.block_hashes]
        ing.apply("e", DecodedBatch(b"kv", step, now[0], list(evs), None, 0))
        now[0] += 0.05
        if step % 25 == 24:
            ing.flush()
            rep = loop.tick()
            assert rep.outcome == "ok" and not rep.fallbacks, (step, rep.fallbacks)
            decisions += rep.decisions
    assert idx.reclaimed > 1_000 and len(idx) <= 3_000 and ing.index_skipped == 0
    assert not loop.errors and loop.placement is not None and loop.placement.errors == 0
    assert decisions > 0
    blocks = {d.block for d in loop.decisions.query(limit=10_000)}
    assert blocks and blocks <= seen  # 63-bit hashes: the index's int64 keys are the hashes themselves
    assert ing.blocks_tracked()["gpu"] == len(live)
