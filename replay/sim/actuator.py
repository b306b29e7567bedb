"""``memory``: the actuator for the simulator's cache layer, behind the normal :class:`Actuator` interface.

It applies the sidecar's moves to a :class:`~kvtier.replay.sim.layer.CacheLayer` at the simulated time the
tick runs: a promote / prefetch reserves the ``src->dst`` link (the block is usable once its transfer
ends, so a prefetch competes with demand loads for bandwidth), a demote copies (if needed) then frees, an
evict frees. Only the layer's own tiers (L1, L2, ...) are addressable, as with LMCache; vLLM's HBM is not.
Keys are the loop's 16-hex-digit block keys. ``applied`` counts what the layer did, so the sidecar's
``kvtier_actuations_total{outcome="applied"}`` can be checked against it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from kvtier.controller.actuators.base import (
    ActuationResult,
    Actuator,
    BlockRef,
    Capability,
    KeyOutcome,
    Outcome,
)
from kvtier.policies.index import to_key
from kvtier.policies.tiers import Tier
from kvtier.replay.sim.layer import CacheLayer

_CAPS = frozenset({Capability.PROMOTE, Capability.DEMOTE, Capability.PREFETCH, Capability.EVICT})


class MemoryActuator(Actuator):
    name = "memory"

    def __init__(self, layer: CacheLayer) -> None:
        self.layer = layer
        self.tiers = frozenset(layer.lower)
        self.applied: Counter[str] = Counter()  # action -> moves the layer applied

    def capabilities(self) -> frozenset[Capability]:
        return _CAPS

    def _each(self, action: str, blocks: Sequence[BlockRef], fn: object) -> ActuationResult:
        out = []
        for ref in blocks:
            try:
                b = to_key(int(ref.layer_key, 16))
            except ValueError:
                out.append(KeyOutcome(ref.layer_key, Outcome.FAILED, "bad block key"))
                continue
            why = fn(b)  # type: ignore[operator]
            if why:
                out.append(KeyOutcome(ref.layer_key, Outcome.SKIPPED, why))
            else:
                self.applied[action] += 1
                out.append(KeyOutcome(ref.layer_key, Outcome.APPLIED))
        return ActuationResult(self.name, action, out, attempts=1)

    def promote(self, blocks: Sequence[BlockRef], to: Tier) -> ActuationResult:
        return self._each("promote", blocks, lambda b: self.layer.promote(b, to))

    def prefetch(self, blocks: Sequence[BlockRef], to: Tier) -> ActuationResult:
        return self._each("prefetch", blocks, lambda b: self.layer.promote(b, to))

    def demote(self, blocks: Sequence[BlockRef], to: Tier) -> ActuationResult:
        return self._each("demote", blocks, lambda b: self.layer.demote(b, to))

    def evict(self, blocks: Sequence[BlockRef], tier: Tier | None = None) -> ActuationResult:
        return self._each("evict", blocks, lambda b: self.layer.evict(b, tier))


def build(*, layer: CacheLayer) -> Actuator:
    """Registry factory: ``layer`` is the simulator's cache layer object (``actuator_options``)."""
    if not isinstance(layer, CacheLayer):
        raise ValueError("memory actuator: option 'layer' must be a kvtier.replay.sim CacheLayer")
    return MemoryActuator(layer)
