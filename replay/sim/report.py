"""Residency reports from the simulated layer into a sidecar's block index (what KV events would say)."""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.policies.index import BlockIndex
from kvtier.policies.tiers import Tier


class IndexReporter:
    """:class:`~kvtier.replay.sim.layer.ResidencyObserver` writing into a :class:`BlockIndex`; times in the
    index are milliseconds of ``t0_s + now`` (the sidecar's clock)."""

    def __init__(self, index: BlockIndex, block_bytes: int, t0_s: float = 0.0) -> None:
        self.index = index
        self.block_bytes = block_bytes
        self.t0_s = t0_s

    def stored(self, block: int, parent: int | None, tier: Tier, now: float) -> None:
        self.index.store(block, parent, tier, self.block_bytes, (self.t0_s + now) * 1e3)

    def removed(self, block: int, tier: Tier) -> None:
        self.index.remove(block, tier)

    def accessed(self, chain: Sequence[int], now: float) -> None:
        self.index.access_chain(chain, (self.t0_s + now) * 1e3)
