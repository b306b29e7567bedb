"""``shadow``: an actuator that does nothing but record; every call is a shadow decision.

The loop records every decision in the audit trail and scores it counterfactually
(:mod:`kvtier.controller.decisions`); this adapter lets ``--actuator shadow`` stand in for a real layer
(all capabilities advertised, nothing touched), e.g. to dry-run an ``active`` configuration.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.controller.actuators.base import (
    ActuationResult,
    Actuator,
    BlockRef,
    Capability,
    KeyOutcome,
    Outcome,
)
from kvtier.policies.tiers import Tier

_CAPS = frozenset(
    {Capability.PROMOTE, Capability.DEMOTE, Capability.PREFETCH, Capability.PIN, Capability.EVICT}
)


class ShadowActuator(Actuator):
    name = "shadow"
    records_only = True  # every call is a shadow decision

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[str, ...], str | None]] = []

    def capabilities(self) -> frozenset[Capability]:
        return _CAPS

    def _rec(self, action: str, blocks: Sequence[BlockRef], tier: Tier | None) -> ActuationResult:
        self.calls.append((action, tuple(b.layer_key for b in blocks), tier.value if tier else None))
        return ActuationResult(
            self.name, action, [KeyOutcome(b.layer_key, Outcome.SKIPPED, "shadow: recorded") for b in blocks]
        )

    def promote(self, blocks: Sequence[BlockRef], to: Tier) -> ActuationResult:
        return self._rec("promote", blocks, to)

    def demote(self, blocks: Sequence[BlockRef], to: Tier) -> ActuationResult:
        return self._rec("demote", blocks, to)

    def prefetch(self, blocks: Sequence[BlockRef], to: Tier) -> ActuationResult:
        return self._rec("prefetch", blocks, to)

    def pin(self, blocks: Sequence[BlockRef], tier: Tier, ttl_s: float | None = None) -> ActuationResult:
        return self._rec("pin", blocks, tier)

    def evict(self, blocks: Sequence[BlockRef], tier: Tier | None = None) -> ActuationResult:
        return self._rec("evict", blocks, tier)
