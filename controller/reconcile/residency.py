"""What applied actuations established in the cache layers' own tiers (the index sees only vLLM's).

The index only sees vLLM's own (GPU) residency; applied moves overlay their effect in the layer's tiers
(pin/promote -> resident there, demote -> moved down, evict -> gone) on the observed tier mask. Pins a
layer acknowledged are remembered so they can be released there when the operator removes them.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from kvtier.controller.actuators.base import Actuator, BlockRef
from kvtier.policies.index import BlockIndex
from kvtier.policies.planner import Move, tier_bit
from kvtier.policies.tiers import Tier


class LayerState:
    """The residency overlay and the layer pins, shared by the observe and act stages."""

    def __init__(self) -> None:
        # block -> (bits of layer-managed tiers, bits resident there) learned from applied actuations
        self.residency: dict[int, tuple[int, int]] = {}
        self.pinned_at_layer: set[int] = set()  # blocks a layer holds pinned (the planner skips them)
        # block -> (actuator, ref, tier) of pins a layer acknowledged (unpinned there when the pin goes)
        self.layer_pins: dict[int, tuple[str, BlockRef, Tier]] = {}

    def overlay(self, mask: npt.NDArray[np.uint8], index: BlockIndex, n: int) -> None:
        """Apply the learned layer residency to the observed tier ``mask`` of rows ``[0, n)`` in place."""
        for h, (managed, bits) in list(self.residency.items()):
            r = index.slot_of(h)
            if 0 <= r < n:
                mask[r] = (int(mask[r]) & ~managed) | bits

    def learn(self, act: Actuator, m: Move) -> None:
        """Overlay the effect of an applied move in the layer's own tiers (the index cannot see them)."""
        tiers = act.tiers
        if not tiers:
            return
        managed = 0
        for t in tiers:
            managed |= tier_bit(t)
        _, bits = self.residency.get(m.block, (managed, 0))
        if m.action in ("demote", "evict") and m.src is not None and m.src in tiers:
            bits &= ~tier_bit(m.src)
        elif m.action == "evict":
            bits = 0
        if m.action != "evict" and m.dst is not None and m.dst in tiers:
            bits |= tier_bit(m.dst)
        if bits:
            self.residency[m.block] = (managed, bits)
        else:
            self.residency.pop(m.block, None)

    def pinned(self, block: int, layer: str, ref: BlockRef, tier: Tier) -> None:
        """A layer holds ``block`` pinned in ``tier`` (or had nothing to hold)."""
        self.pinned_at_layer.add(block)
        self.layer_pins[block] = (layer, ref, tier)

    def forget_pin(self, block: int) -> None:
        self.layer_pins.pop(block, None)
        self.pinned_at_layer.discard(block)
